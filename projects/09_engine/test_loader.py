"""models/loader.py reads only files inside the model directory: a safetensors index whose weight_map
names a shard by an absolute path or through `..` is refused with an error naming the entry (issue 31)."""

from __future__ import annotations

import json

import pytest

from kernel_lab.models.loader import safetensors_files


def _index(tmp_path, *shards):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}))
    return tmp_path


def test_shards_inside_the_directory_are_listed(tmp_path):
    model = _index(tmp_path, "model-00001.safetensors", "sub/model-00002.safetensors", "model-00001.safetensors")
    assert safetensors_files(model) == [model / "model-00001.safetensors", model / "sub/model-00002.safetensors"]


@pytest.mark.parametrize("entry", ["../secrets.safetensors", "sub/../../x.safetensors", "/etc/passwd", "", 3])
def test_a_weight_map_entry_outside_the_directory_is_refused(tmp_path, entry):
    with pytest.raises(ValueError, match="weight_map entry") as caught:
        safetensors_files(_index(tmp_path, "model.safetensors", entry))
    assert repr(entry) in str(caught.value)
