"""The README's demo: requests that share a long prefix, through a running cluster.

Prints, for each request, the cached tokens, TTFT, decode tokens/s and which workers served
it, and checks the last answer (the cached one) against the single-process engine.
"""

from __future__ import annotations

import sys

import grpc

from conductor.client import Client

SHARED = ("You are the on-call assistant for a storage cluster. Answer briefly and cite the runbook. "
          "Runbook: 1) check the disk health dashboard; 2) drain the node; 3) replace the drive; "
          "4) rebuild the replica; 5) close the incident with a summary. ") * 4
QUESTIONS = ["Disk 7 on node 12 reports errors. What now?",
             "A node is slow after a drive swap. What now?",
             "How do I close the incident?",
             "Disk 7 on node 12 reports errors. What now?"]


def run_demo(endpoint: str, max_tokens: int = 24, api_key: str = "", tls_ca: str = "") -> int:
    client = Client(endpoint, api_key=api_key, tls_ca=tls_ca)
    print(f"{'#':>2}  {'prompt':>6}  {'cached':>6}  {'TTFT ms':>8}  {'tok/s':>6}  workers            text")
    try:
        for i, q in enumerate(QUESTIONS):
            out = client.generate(Client.request(SHARED + q, max_tokens=max_tokens))
            print(f"{i:>2}  {out.prompt_tokens:>6}  {out.cached_tokens:>6}  {out.ttft_s * 1e3:>8.1f}  "
                  f"{out.decode_tokens_per_s:>6.1f}  {out.prefill_worker + '->' + out.decode_worker:<18} "
                  f"{out.text[:40]!r}")
            if out.finish_reason not in ("stop", "length"):
                print(f"request {i} ended {out.finish_reason}: {out.error}", file=sys.stderr)
                return 1
    except grpc.RpcError as e:
        print(f"demo failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return _check_against_engine(SHARED + QUESTIONS[-1], out.token_ids, max_tokens)


def _check_against_engine(text: str, cluster_tokens: list[int], max_tokens: int) -> int:
    """The last answer, recomputed by the single-process engine: the cluster must match it."""
    import engine

    model = engine.load_model("tiny")
    want = engine.generate(model, model.tokenizer.encode(text), max_tokens)
    same = want == cluster_tokens
    print(f"single-process engine gives the same {len(want)} tokens: {'yes' if same else 'NO'}")
    return 0 if same else 1
