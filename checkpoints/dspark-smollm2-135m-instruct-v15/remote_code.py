"""The code a drafter folder carries, so that it loads with ``trust_remote_code=True`` where this project is not
installed and ``target.generate(assistant_model=drafter)`` works there as it does here.

Transformers loads remote code from the folder itself: the module its ``auto_map`` names and the sibling files
that module imports relatively, all in one flat directory. So the payload is generated from this project's
source when a drafter is saved: the modules the drafter's class reaches through the project's imports (the
model, its heads, its losses, and ``generation.decoding`` with the hook that routes ``generate()``), each
written as one flat file, its project imports rewritten as relative ones and its name as Transformers names
model code (``configuration_dspark.py``, ``modeling_dspark.py``). Nothing in a folder's payload is edited by
hand; ``tests/checkpoint/test_remote_code.py`` compares every shipped folder with what this module generates now.
Run from a folder's own copy (a drafter loaded with remote code and saved again), the same walk finds the
flat files already in their final form and writes them unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

__all__ = ["RemoteCodeMixin", "checkpoint_auto_map", "generated_payload", "payload_files", "payload_problems", "write_remote_code"]

# the project's top-level packages: their imports inside the payload become relative ones
PROJECT_PACKAGES = ("modeling_dspark", "generation")
# a source module's name -> its file name in a checkpoint (Transformers' naming of model code)
CHECKPOINT_NAMES = {
    "config": "configuration_dspark",
    "model": "modeling_dspark",
    "eagle3_config": "configuration_eagle3",
    "eagle3_model": "modeling_eagle3",
}
_FROM_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<module>\.?[\w.]+)[ \t]+import[ \t]", re.M)
_PLAIN_IMPORT = re.compile(r"^[ \t]*import[ \t]+(?P<module>[\w.]+)", re.M)


def _checkpoint_name(module_file: Path) -> str:
    return CHECKPOINT_NAMES.get(module_file.stem, module_file.stem)


def _is_project(module: str) -> bool:
    return module.startswith(".") or module.split(".")[0] in PROJECT_PACKAGES


def _module_file(module: str, importer: Path) -> Path:
    """The file of a project module imported by ``importer``: a sibling for a relative import (the flat payload),
    found by the import system for an absolute one."""
    if module.startswith("."):
        if module.startswith(".."):
            raise ValueError(f"{importer}: the payload is flat, '{module}' cannot be resolved in it")
        path = importer.with_name(module[1:] + ".py")
    else:
        spec = importlib.util.find_spec(module)
        path = Path(spec.origin) if spec is not None and spec.origin else None
    if path is None or not path.is_file() or path.name == "__init__.py":
        raise ValueError(f"{importer} imports {module!r}: payload modules must import concrete project modules")
    return path


def payload_files(model_class) -> dict[str, Path]:
    """``{file name in the checkpoint: source file}`` for the modules ``model_class`` reaches through the project's
    imports (at module level or inside functions, since Transformers checks both when it loads remote code)."""
    start = Path(sys.modules[model_class.__module__].__file__)
    config_class = getattr(model_class, "config_class", None)
    todo = [start] + ([Path(sys.modules[config_class.__module__].__file__)] if config_class is not None else [])
    found: dict[str, Path] = {}
    while todo:
        path = todo.pop()
        name = _checkpoint_name(path) + ".py"
        if name in found:
            if found[name] != path:
                raise ValueError(f"two payload modules would both be {name}: {found[name]} and {path}")
            continue
        found[name] = path
        text = path.read_text()
        for match in _PLAIN_IMPORT.finditer(text):
            if _is_project(match["module"]):
                raise ValueError(f"{path}: write 'from {match['module']} import ...' so the payload can be flattened")
        todo += [_module_file(m["module"], path) for m in _FROM_IMPORT.finditer(text) if _is_project(m["module"])]
    return dict(sorted(found.items()))


def _flatten(path: Path) -> str:
    """The text of ``path`` with its project imports made relative to the flat payload."""

    def relative(match: re.Match) -> str:
        module = match["module"]
        if not _is_project(module):
            return match[0]
        return f"{match['indent']}from .{_checkpoint_name(_module_file(module, path))} import "

    return _FROM_IMPORT.sub(relative, path.read_text())


def checkpoint_auto_map(config_class, model_class) -> dict[str, str]:
    """``auto_map`` of a saved folder: the Auto classes -> ``<payload module>.<class>``."""

    def ref(cls) -> str:
        return f"{_checkpoint_name(Path(sys.modules[cls.__module__].__file__))}.{cls.__name__}"

    return {"AutoConfig": ref(config_class), "AutoModel": ref(model_class)}


def generated_payload(model_class) -> dict[str, str]:
    """``{file name: text}`` of the payload as the current source generates it."""
    return {name: _flatten(path) for name, path in payload_files(model_class).items()}


def write_remote_code(folder: str | Path, model_class) -> list[str]:
    """Write ``model_class``'s payload into ``folder`` (removing stale ``.py`` files a previous save left) and its
    ``auto_map`` into ``folder/config.json``; returns the file names written."""
    folder = Path(folder)
    payload = generated_payload(model_class)
    for stale in folder.glob("*.py"):
        if stale.name not in payload:
            stale.unlink()
    for name, text in payload.items():
        (folder / name).write_text(text)
    config_path = folder / "config.json"
    auto_map = checkpoint_auto_map(model_class.config_class, model_class)
    if config_path.is_file() and (config := json.loads(config_path.read_text())).get("auto_map") != auto_map:
        config["auto_map"] = auto_map  # save_pretrained has written it already; a folder regenerated alone may lack it
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(payload)


def payload_problems(folder: str | Path, model_class) -> list[str]:
    """What differs between ``folder``'s remote code and what the source generates now (empty when none)."""
    folder = Path(folder)
    payload = generated_payload(model_class)
    problems = [f"{name} is missing" for name in payload if not (folder / name).is_file()]
    problems += [f"{name} is stale" for name in payload if (folder / name).is_file() and (folder / name).read_text() != payload[name]]
    problems += [f"{path.name} is not generated by the source" for path in sorted(folder.glob("*.py")) if path.name not in payload]
    config_path = folder / "config.json"
    auto_map = json.loads(config_path.read_text()).get("auto_map") if config_path.is_file() else None
    expected = checkpoint_auto_map(model_class.config_class, model_class)
    if auto_map != expected:
        problems.append(f"config.json auto_map is {auto_map}, expected {expected}")
    return problems


class RemoteCodeMixin:
    """``save_pretrained`` writes the folder's remote code and ``auto_map`` (generated, see this module)."""

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False, **kwargs):
        if push_to_hub:  # Transformers would upload before the remote code below is written
            raise ValueError("save the drafter first, then upload the folder: drafter.push_to_hub(repo_id) or `dspark push FOLDER REPO`")
        self.config.auto_map = checkpoint_auto_map(type(self.config), type(self))
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            write_remote_code(save_directory, type(self))
