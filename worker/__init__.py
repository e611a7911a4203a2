"""Sluice's worker side: storage, shard runs, the engine-backed rq worker and the finalize job."""
