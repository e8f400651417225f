"""Assemble a folder that can be uploaded as a Hugging Face Space (``sdk: gradio``).

    python -m hub_cards.space.build space_out/
    # then: huggingface_hub.upload_folder(folder_path="space_out", repo_id="<user>/dspark-demo", repo_type="space")

The Space runs ``hub_cards/space/app.py`` from a copy of this project's packages and the shipped drafter, with
the Space's README header at the top level.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from generation.cli import SHIPPED_DRAFTER

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["modeling_dspark", "generation", "hub_cards", SHIPPED_DRAFTER.relative_to(ROOT).as_posix()]


def build_space(out: str | Path) -> list[str]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in PARTS:
        shutil.copytree(ROOT / part, out / part, ignore=ignore, dirs_exist_ok=True)
    here = Path(__file__).parent
    shutil.copy(here / "README.md", out / "README.md")
    shutil.copy(here / "requirements.txt", out / "requirements.txt")
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    args = parser.parse_args(argv)
    files = build_space(args.out)
    print(f"{len(files)} files in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
