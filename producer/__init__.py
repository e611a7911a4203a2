"""Sluice's producer side: the job contract, batch records in Redis, shards, the client and the CLI."""

from producer.client import BatchNotFound, Client
from producer.schemas import Batch, BatchStatus, OutputRecord

__all__ = ["Batch", "BatchNotFound", "BatchStatus", "Client", "OutputRecord"]
