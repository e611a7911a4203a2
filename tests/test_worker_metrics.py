"""The worker's Prometheus series follow the engine's steps through LLM.add_step_observer."""

from __future__ import annotations

from sluice.engine import LLM, SamplingParams
from sluice.worker.metrics import WorkerMetrics


def test_worker_metrics_observe_every_step_through_the_llms_hook(tiny_llama):
    """Each llm.step is timed and its finished requests and tokens counted, with LLM.step itself left alone."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    metrics = WorkerMetrics("tiny")
    metrics.instrument(llm)
    assert "step" not in vars(llm)  # observed, not replaced
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.add_request("a", [1, 2, 3], params)
    llm.add_request("b", [4, 5], params)
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    value = metrics.registry.get_sample_value
    assert steps >= 3 and value("sluice_step_seconds_count") == steps
    assert value("sluice_requests_total", {"outcome": "length"}) == 2
    assert value("sluice_generation_tokens_total") == 6 and value("sluice_prompt_tokens_total") == 5
