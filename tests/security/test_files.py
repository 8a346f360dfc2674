"""Issue 20's finding 5: what a real cluster writes is its owner's only, whatever the umask.

A cluster (Conductor + 1 prefill + 1 decode processes, TLS and API keys) is started under
umask 000, so every mode below is one the code chose, not one the umask gave. After a
request whose blocks reach the SSD tier: block files 0600 in 0700 directories, logs 0600 in
a 0700 directory, the secret, the TLS key, the keys file and the state file 0600, and
neither the cluster secret nor the API key appears in any process's argv or environment or
in any log."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import engine
from conductor.apikeys import add_key
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_real_clusters_files_are_the_owners_only(tmp_path):
    keys = tmp_path / "keys.json"
    api_key = add_key(str(keys), "acme")
    # No device tier and 64 KiB of DRAM: snapshot blocks go to SSD at once (tests/e2e/test_corruption.py).
    args = WORKER_ARGS + ("--device-bytes", "0", "--dram-bytes", str(64 << 10))
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=args, decode_args=DECODE_ARGS, tls=True,
                           api_keys=str(keys), data_dir=str(tmp_path / "data"))
    old = os.umask(0)
    try:
        cluster = LocalCluster(config)
        cluster.start()
    finally:
        os.umask(old)
    try:
        ids = prompt(160, 7000)
        client = Client(cluster.endpoint, api_key=api_key, tls_ca=cluster.tls.ca)
        out = client.generate(Client.request(ids, max_tokens=4))
        client.close()
        assert out.finish_reason == "length" and out.token_ids == engine.generate(engine.load_model("tiny"), ids, 4)
        data, ssd = cluster.data_dir, cluster.data_dir / "prefill-0" / "ssd"
        blocks = sorted(ssd.glob("*.blk"))
        assert blocks, f"no block reached the SSD tier: {sorted(p.name for p in ssd.iterdir())}"
        deadline = time.monotonic() + 30
        while not cluster.state_file.exists():
            assert time.monotonic() < deadline, "no state file"
            time.sleep(0.1)
        logs = sorted(cluster.log_dir.glob("*.log"))
        assert {p.stem for p in logs} == {"conductor", "prefill-0", "decode-0"}
        want = {data: 0o700, data / "prefill-0": 0o700, ssd: 0o700, cluster.log_dir: 0o700,
                cluster.secret_file: 0o600, Path(cluster.tls.key): 0o600, keys: 0o600, cluster.state_file: 0o600,
                **{p: 0o600 for p in blocks + logs}}
        found = {str(p.relative_to(tmp_path)): oct(mode(p)) for p in want}
        assert found == {str(p.relative_to(tmp_path)): oct(m) for p, m in want.items()}
        secret = cluster.secret_file.read_text().strip()
        for name, proc in cluster.procs.items():
            for part in ("cmdline", "environ"):
                text = Path(f"/proc/{proc.pid}/{part}").read_bytes().decode(errors="replace")
                assert secret not in text and api_key not in text, f"a credential in {name}'s {part}"
        for p in logs:
            text = p.read_text()
            assert secret not in text and api_key not in text, f"a credential in {p.name}"
    finally:
        cluster.stop()
