"""One Pillow decode: the contract and the engine read image bytes through sluice.image_codec, which imports
nothing of the project (the contract may not import the engine, nor the engine the contract)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from sluice import image_codec
from sluice.contract import images
from sluice.engine.multimodal import image_decode
from tests.test_images import data_url, encoded, gradient

SHARED = ("ImageError", "data_url_bytes", "decode_image", "image_hash")


def test_the_contract_and_the_engine_decode_with_the_one_codec():
    for name in SHARED:
        assert getattr(images, name) is getattr(image_decode, name) is getattr(image_codec, name), name
    image = gradient(30, 20)
    url = data_url(encoded(image))
    loaded = images.load_image(url, images.ImageSettings())
    assert image_codec.image_hash(image_decode.load_data_url(url)) == loaded.content_hash


def test_the_codec_imports_only_the_standard_library_and_pillow():
    tree = ast.parse(Path(image_codec.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {n.split(".")[0] for n in names} == {"__future__", "base64", "binascii", "hashlib", "io", "re",
                                                  "typing", "PIL"}
    code = ("import sys, sluice.image_codec; "
            "assert not {'torch', 'sluice.engine', 'sluice.contract'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
