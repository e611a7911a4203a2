"""Sluice's worker side: shard runs, the engine-backed rq worker, the finalize job and webhook delivery."""
