"""A model's config as transformers normalises it, without importing transformers' config classes in this process.

Every config class of transformers 5 imports its type validators, and those import the modeling stack (torch
dynamo, sympy, triton, torch.distributed.tensor): about 150 MiB of resident memory before a weight is read,
which the serving process would carry for its whole life (bench/served_memory.py). The server needs only the
values, so the config is normalised (defaults filled, legacy RoPE fields folded into ``rope_parameters``,
``layer_types`` derived) by transformers in a short child process, once per config.json and transformers
version, and cached as JSON under ``cache_dir/configs``. The values come back as a plain ``PreTrainedConfig``
(the base class, which imports none of that), so code written against transformers' config objects reads them
unchanged. A process that has already paid for the config classes (a build, the tests) normalises in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from quant.errors import ModelSourceError

_HEAVY = "transformers.utils.type_validators"  # imported by every config class; pulls in the modeling stack
_CHILD_TIMEOUT_S = 300


def normalise(raw: dict) -> dict:
    """config.json's dict (less any quantization_config) -> every field transformers' config class for its
    model_type gives, defaults included. Imports the config classes: run in a child unless already paid for."""
    from transformers import AutoConfig

    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    if "model_type" not in raw:
        raise ValueError("config.json has no model_type")
    return json.loads(AutoConfig.for_model(**raw).to_json_string(use_diff=False))


def _normalise_in_child(config_json: Path) -> dict:
    cmd = [sys.executable, "-m", "quant.format.model_config", str(config_json)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S,
                              env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    except subprocess.TimeoutExpired:
        raise ModelSourceError(f"reading {config_json} took over {_CHILD_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        raise ModelSourceError(f"transformers cannot read {config_json}: {lines[-1] if lines else done.returncode}")
    return json.loads(done.stdout)


def _cache_path(cache_dir: Path, text: bytes) -> Path:
    key = hashlib.sha256(text).hexdigest()[:20]
    return Path(cache_dir) / "configs" / f"{key}-transformers-{metadata.version('transformers')}.json"


def read(model_dir: str | Path, cache_dir: str | Path | None = None, in_process: bool | None = None):
    """The normalised config of the model dir (its config.json), as a ``PreTrainedConfig`` carrying every field.
    ``in_process``: None normalises here when the config classes are already imported or there is no cache
    dir, else in a child (cached); True / False force either way."""
    from transformers.configuration_utils import PreTrainedConfig

    path = Path(model_dir) / "config.json"
    try:
        text = path.read_bytes()
        raw = json.loads(text)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelSourceError(f"{path} is not a JSON object")
    if in_process is None:
        in_process = _HEAVY in sys.modules or cache_dir is None
    if in_process:
        try:
            values = normalise(raw)
        except Exception as e:  # noqa: BLE001 - any failure to read a user's config is a bad model source
            raise ModelSourceError(f"transformers cannot read {path}: {type(e).__name__}: {e}") from None
    else:
        cached = _cache_path(Path(cache_dir), text)
        try:
            values = json.loads(cached.read_text())
        except (OSError, ValueError):
            values = _normalise_in_child(path)
            cached.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(values, f)
            os.replace(tmp, cached)  # concurrent servers race to the same content
    values.pop("transformers_version", None)
    values["_name_or_path"] = str(model_dir)  # as from_pretrained sets it (the cache is keyed by content, not path)
    config = PreTrainedConfig(**values)
    for key, value in values.items():  # the base class keeps a few fields (use_cache) for its subclasses to set
        if key not in vars(config):
            setattr(config, key, value)
    return config


def generation_eos(model_dir: str | Path) -> int | list[int] | None:
    """generation_config.json's eos_token_id (what ``generate`` stops on), without transformers' GenerationConfig."""
    path = Path(model_dir) / "generation_config.json"
    try:
        return json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


if __name__ == "__main__":  # the child: config.json path in, normalised JSON out
    print(json.dumps(normalise(json.loads(Path(sys.argv[1]).read_text()))))
