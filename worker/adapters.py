"""The LoRA adapters a worker serves, by the name a line gives as `model`: `--lora NAME=PATH` flags and
`--lora-dir DIR` folders (local, or s3:// copied into the local cache when first asked for).

A name under a `--lora-dir` is found when a line first asks for it, so workers sharing an s3:// folder of
adapters all serve every adapter in it, including ones added after they started.
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

from sluice.contract.settings import adapter_cache
from sluice.contract.storage import S3_STYLE, open_storage
from sluice.engine.lora.adapter import CONFIG, WEIGHTS
from sluice.engine.lora.lora_request import LoRARequest

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
S3 = "s3://"


class AdapterSpecError(ValueError):
    """A --lora / --lora-dir flag that cannot be used."""


class Adapters:
    """Adapter names to LoRARequests (stable integer ids in order of first use)."""

    def __init__(self, named: dict[str, str] | None = None, dirs: list[str] | None = None,
                 cache: str | Path | None = None, s3_style: str = S3_STYLE) -> None:
        self.named = dict(named or {})
        self.dirs = [d.rstrip("/") for d in dirs or []]
        self.cache = Path(cache or adapter_cache())
        self.s3_style = s3_style
        self._requests: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()
        for name, path in self.named.items():
            if not NAME.match(name):
                raise AdapterSpecError(f"--lora {name}={path}: the name must be letters, digits and ._:@/-")
            if not path.startswith(S3) and not (Path(path) / CONFIG).is_file():
                raise AdapterSpecError(f"--lora {name}={path}: no {CONFIG} there")
        for d in self.dirs:
            if not d.startswith(S3) and not Path(d).is_dir():
                raise AdapterSpecError(f"--lora-dir {d}: not a folder")

    @classmethod
    def from_flags(cls, loras: list[str], dirs: list[str], **kw) -> Adapters:
        """From repeated `--lora NAME=PATH` values and `--lora-dir DIR` values."""
        named = {}
        for spec in loras:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise AdapterSpecError(f"--lora {spec!r}: expected NAME=PATH")
            named[name] = path
        return cls(named, dirs, **kw)

    def __bool__(self) -> bool:
        return bool(self.named or self.dirs)

    def names(self) -> list[str]:
        """The names known now: every --lora, and the adapter folders inside local --lora-dir folders."""
        found = set(self.named)
        for d in self.dirs:
            if not d.startswith(S3):
                found.update(p.parent.name for p in Path(d).glob(f"*/{CONFIG}") if NAME.match(p.parent.name))
        return sorted(found)

    def get(self, name: str) -> LoRARequest | None:
        """The adapter a line's `model` names, or None where this worker has none of that name."""
        with self._lock:
            if name in self._requests:
                return self._requests[name]
            path = self._locate(name)
            if path is None:
                return None
            request = self._requests[name] = LoRARequest(name, len(self._requests) + 1, path)
            return request

    def _locate(self, name: str) -> str | None:
        if name in self.named:
            return self._local(self.named[name])
        if not NAME.match(name) or ".." in name.split("/"):
            return None
        for d in self.dirs:
            candidate = f"{d}/{name}"
            if d.startswith(S3):
                if open_storage(candidate, self.s3_style).exists(CONFIG):
                    return self._local(candidate)
            elif (Path(candidate) / CONFIG).is_file():
                return candidate
        return None

    def _local(self, path: str) -> str:
        """A local folder holding the adapter: the path itself, or an s3:// adapter copied into the cache
        once."""
        if not path.startswith(S3):
            return path
        folder = self.cache / hashlib.sha256(path.encode()).hexdigest()[:24]
        if not (folder / WEIGHTS).is_file():
            storage = open_storage(path, self.s3_style)
            folder.mkdir(parents=True, exist_ok=True)
            for key in (CONFIG, WEIGHTS):
                tmp = folder / f".{key}.part"
                if storage.exists(key):
                    tmp.write_bytes(storage.get(key))
                    tmp.replace(folder / key)
        return str(folder)


class ServedModels:
    """The names a worker answers to: its model's names, then its adapters' (looked up on first use)."""

    def __init__(self, names: set[str], adapters: Adapters) -> None:
        self.names, self.adapters = set(names), adapters

    def __contains__(self, name: object) -> bool:
        return name in self.names or (isinstance(name, str) and self.adapters.get(name) is not None)

    def __iter__(self):
        return iter(sorted(self.names | set(self.adapters.names())))

    def adapter(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        if name is None or name in self.names:
            return None
        return self.adapters.get(name)
