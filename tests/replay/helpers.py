"""Hand-made RequestRecords for the stats, summary and report tests."""

from replay.records import RequestRecord


def rec(i: int, outcome: str = "finished", *, arrival: float = 0.0, ttft: float | None = 0.1,
        gaps: tuple[float, ...] = (0.05,), prompt: int = 100, cached: int = 0, prefill: str = "prefill-0",
        decode: str = "decode-0", queue: float | None = None, source: str = "live", **kw) -> RequestRecord:
    times: tuple[float, ...] = ()
    if outcome == "finished" and ttft is not None:
        times = [ttft]
        for g in gaps:
            times.append(times[-1] + g)
        times = tuple(times)
    finished = outcome == "finished"
    return RequestRecord(
        request_id=f"t{i}", index=i, source=source, outcome=outcome, scheduled_s=arrival, arrival_s=arrival,
        prompt_len=prompt, max_tokens=len(times) or 4, ttft_s=ttft if finished else None,
        latency_s=(times[-1] if times else 0.01), queue_s=queue, token_times_s=times,
        prompt_tokens=prompt if finished else 0, cached_tokens=cached,
        prefill_worker=prefill if outcome != "rejected" else "", decode_worker=decode if finished else "",
        status="OK" if outcome != "rejected" else "RESOURCE_EXHAUSTED", **kw)
