"""Sluice's producer side: validation, shards, the client and cron pipelines (the job contract is
`contract`)."""

from sluice.contract.schemas import Batch, BatchStatus, OutputRecord
from sluice.producer.client import BatchNotFound, Client

__all__ = ["Batch", "BatchNotFound", "BatchStatus", "Client", "OutputRecord"]
