"""Upload a drafter folder to the Hub with ``huggingface_hub`` (its remote code included, so it loads with
``trust_remote_code=True`` where this package is not installed).

    python -m hub_cards.push checkpoints/dspark-smollm2-135m-instruct <user>/dspark-smollm2-135m-instruct [--dry-run]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from modeling_dspark.checkpoint.remote_code import payload_problems

__all__ = ["drafter_class", "push_drafter", "remote_code_files"]

WEIGHTS = ("model.safetensors", "adapter_model.safetensors")


def drafter_class(model_type: str | None):
    """The drafter class of a folder's ``model_type``."""
    from modeling_dspark import DRAFTER_CLASSES

    if model_type not in DRAFTER_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not a drafter of this project ({', '.join(DRAFTER_CLASSES)})")
    return DRAFTER_CLASSES[model_type]


def remote_code_files(folder: str | Path) -> list[str]:
    """The files a drafter folder must carry, checked: config, weights, card, and its remote code, which must be
    what the source generates now."""
    folder = Path(folder)
    config_path = folder / "config.json"
    adapter = (folder / "adapter_config.json").is_file()
    if not config_path.is_file() and not adapter:
        raise FileNotFoundError(f"{folder} has no config.json (nor adapter_config.json)")
    needed = ["adapter_config.json"] if adapter else ["config.json"]
    weights = [w for w in WEIGHTS if (folder / w).is_file()]
    if not weights:
        raise FileNotFoundError(f"{folder} has no weights ({' or '.join(WEIGHTS)})")
    needed += weights
    if not adapter:
        auto_map = json.loads(config_path.read_text()).get("auto_map") or {}
        if not auto_map:
            raise ValueError(f"{config_path} has no auto_map: save the drafter with this package so it carries its code")
        problems = payload_problems(folder, drafter_class(json.loads(config_path.read_text()).get("model_type")))
        if problems:
            raise ValueError(f"{folder}'s remote code is not what the source generates ({'; '.join(problems)}): save the drafter again")
        needed += sorted(path.name for path in folder.glob("*.py"))
    if not (folder / "README.md").is_file():
        raise FileNotFoundError(f"{folder} has no README.md model card: run python -m hub_cards.cards {folder}")
    needed.append("README.md")
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}")
    return needed


def upload_files(folder: str | Path) -> list[str]:
    """Every file ``push_drafter`` sends: the folder's files (relative paths, sorted) without Python caches."""
    folder = Path(folder)
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def push_drafter(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None, dry_run: bool = False, api=None):
    """Check ``folder`` (``remote_code_files``), create ``repo_id`` if needed and upload exactly ``upload_files(folder)``;
    returns that list (and, unless ``dry_run``, the commit info)."""
    remote_code_files(folder)
    files = upload_files(folder)
    if dry_run:
        return files, None
    from huggingface_hub import HfApi

    api = api or HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                             commit_message="Upload drafter", allow_patterns=files)  # fmt: skip
    return files, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("repo_id")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="check the folder and list every file the upload would send")
    args = parser.parse_args(argv)
    try:
        files, info = push_drafter(args.folder, args.repo_id, private=args.private, dry_run=args.dry_run)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print("\n".join(files))
    if info is not None:
        print(f"uploaded to {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
