"""The job contract producer and worker share and neither owns: schemas, batch store, settings, storage,
webhook signing and events, job ids. It imports neither side."""
