"""Build every kernel card of kernel-cards/ into a Hub repository tree under build/<card>/.

    python scripts/build_cards.py [--out build] [--cards npu-rms-norm,...]

Per card: `README.md` (the card text plus a generated variants table) and, for each variant of
kernel-cards/variants.toml, `build/<variant>/metadata.json` and `build/<variant>/<python_name>/`
(the card package, the modules of kernel-cards/shared/ its card.toml lists, and a generated
`_build.py`). The output depends only on the sources: same inputs, byte-identical trees. A card is
written to a temporary folder and moved into place whole, so an interrupted build never leaves a
half-written card behind.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kernels import Metadata

from npu_hub_kernels._kernels_compat import Digest, DigestAlgorithm
from npu_hub_kernels.cards import Card as CardConfig
from npu_hub_kernels.models import MODEL_CLASSES

ROOT = Path(__file__).resolve().parent.parent
CARDS_DIR = ROOT / "kernel-cards"
SHARED_DIR = CARDS_DIR / "shared"
_SKIP = {"__pycache__"}
TRANSFORMERS_VERSION = importlib.metadata.version("transformers")
"""The installed (pinned) transformers, which the class tables of npu_hub_kernels.models were established against."""


@dataclass(frozen=True)
class Card(CardConfig):
    """A card source folder: kernel-cards/<name>/ with card.toml, README.md and <python_name>/."""

    path: Path

    @property
    def name(self) -> str:
        return self.repo_name

    @property
    def package_dir(self) -> Path:
        return self.path / self.python_name


@dataclass(frozen=True)
class Variant:
    """One build variant: its folder name, and the CANN/torch/cpu it targets (None for noarch)."""

    name: str
    cann: str | None = None
    torch: str | None = None
    cpu: str | None = None

    @property
    def requires_torch_npu(self) -> bool:
        return self.name != "torch-universal"

    @property
    def backend_type(self) -> str:
        # metadata.json has no "universal" backend; the universal build runs the eager math on any host.
        return "cpu" if self.name == "torch-universal" else "cann"


_RELATIVE_IMPORT = re.compile(r"^from \.(\w+) import", re.MULTILINE)


def load_card(path: Path) -> Card:
    config = CardConfig.from_file(path / "card.toml")
    card = Card(**{field: getattr(config, field) for field in CardConfig.__dataclass_fields__}, path=path)
    if card.name != path.name:
        raise ValueError(f"{path}/card.toml names the card {card.name!r}; the folder must have the same name")
    if not (card.package_dir / "__init__.py").is_file():
        raise ValueError(f"card {card.name}: missing package {card.package_dir.relative_to(ROOT)}/__init__.py")
    imported = _shared_imports(list(card.package_dir.rglob("*.py")))
    if imported != set(card.shared):
        raise ValueError(
            f"card {card.name}: its package imports {sorted(imported)} of kernel-cards/shared/, its card.toml "
            f"lists shared = {sorted(card.shared)}: make the list in card.toml match the imports"
        )
    return card


def _shared_imports(sources: list[Path]) -> set[str]:
    """The files of kernel-cards/shared/ these sources import, and those that the imported ones import in turn."""
    found: set[str] = set()
    while sources:
        modules = {module for source in sources for module in _RELATIVE_IMPORT.findall(source.read_text())}
        new = {f"{module}.py" for module in modules if (SHARED_DIR / f"{module}.py").is_file()} - found
        found |= new
        sources = [SHARED_DIR / name for name in new]
    return found


def load_cards(names: list[str] | None = None) -> list[Card]:
    """The cards of kernel-cards/ (every folder with a card.toml), or the named ones."""
    available = {p.parent.name: p.parent for p in sorted(CARDS_DIR.glob("*/card.toml"))}
    if names:
        unknown = sorted(set(names) - set(available))
        if unknown:
            raise SystemExit(f"unknown card(s) {', '.join(unknown)}; the cards are: {', '.join(available)}")
        return [load_card(available[n]) for n in names]
    return [load_card(p) for p in available.values()]


def variant_matrix() -> list[Variant]:
    """All variants declared in kernel-cards/variants.toml, in a stable order."""
    config = tomllib.loads((CARDS_DIR / "variants.toml").read_text())
    variants = [Variant(name) for name in config["noarch"]]
    for cann, torches in config["cann"].items():
        cann_tag = "cann" + cann.replace(".", "")
        for torch_version in torches:
            torch_tag = "torch" + torch_version.replace(".", "")
            for cpu in config["cpus"]:
                name = f"{torch_tag}-cxx11-{cann_tag}-{cpu}-linux"
                variants.append(Variant(name, cann=cann, torch=torch_version, cpu=cpu))
    return sorted(variants, key=lambda v: v.name)


def _source_files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and not _SKIP.intersection(p.relative_to(directory).parts)
    )


def _build_module(card: Card, variant: Variant) -> str:
    return (
        f'"""Generated by scripts/build_cards.py: which build of {card.name} this is."""\n\n'
        f"CARD = {card.name!r}\n"
        f"CARD_VERSION = {card.version}\n"
        f"VARIANT = {variant.name!r}\n"
        f"REQUIRES_TORCH_NPU = {variant.requires_torch_npu}\n"
    )


def write_variant(card: Card, variant: Variant, variant_dir: Path) -> None:
    """Write one variant folder: the package, then metadata.json with its id and digest."""
    package_out = variant_dir / card.python_name
    package_out.mkdir(parents=True)
    for src in _source_files(card.package_dir):
        dest = package_out / src.relative_to(card.package_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(src.read_bytes())
    for shared in sorted(card.shared):
        (package_out / shared).write_bytes((SHARED_DIR / shared).read_bytes())
    (package_out / "_build.py").write_text(_build_module(card, variant))

    content = hashlib.sha256()
    for path in _source_files(variant_dir):
        content.update(path.relative_to(variant_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    digest = Digest.hash_variant(DigestAlgorithm.SHA256, variant_dir)
    metadata = {
        "name": card.name,
        # The loader imports the module as sys.modules[id]: unique per card, variant and content.
        "id": f"_{card.python_name}_{variant.name.replace('-', '_')}_{content.hexdigest()[:12]}",
        "version": card.version,
        "license": card.license,
        "python-depends": [],
        "backend": {"type": variant.backend_type},
        "digest": {"algorithm": "sha256", "files": dict(sorted(digest.files.items()))},
    }
    metadata_path = variant_dir / "metadata.json"
    metadata_path.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    Metadata.read_from_file(metadata_path)  # the loader's own parser must accept it


def render_models(card: Card) -> str:
    """The transformers classes the mapping swaps this card into, by layer (npu_hub_kernels.models)."""
    rules = MODEL_CLASSES.get(card.kernel_id, [])
    lines = [
        "## Supported transformers classes",
        "",
        f"`npu_hub_kernels.register_npu_kernels()` swaps this card into {len(rules)} classes of transformers "
        f"{TRANSFORMERS_VERSION}, each listed because the layer computes exactly what its forward computes "
        "(the others are left out with a reason in `npu_hub_kernels.models`).",
        "",
        "| layer | classes | model families |",
        "|---|---|---|",
    ]
    for layer in card.layers:
        paths = sorted(rule.path for rule in rules if rule.layer == layer)
        families = sorted({path.split(".")[0] for path in paths})
        lines.append(f"| `{layer}` | {len(paths)} | {', '.join(families)} |")
    return "\n".join(lines)


def render_front_matter(card: Card) -> str:
    """The Hub card metadata, from card.toml: `library_name: kernels` makes the Hub list it as a kernel."""
    tags = "".join(f"  - {tag}\n" for tag in card.tags)
    return f"---\nlibrary_name: kernels\nlicense: {card.license.lower()}\ntags:\n{tags}---\n"


def render_readme(card: Card, variants: list[Variant]) -> str:
    """The card's README after the front matter: its text, benchmark summary, supported classes and build variants.

    The card text comes with its version filled in, then its benchmark summary when `make bench` has written one,
    then the supported classes and the table of build variants.
    """
    rows = ["| variant | torch | CANN | CPU |", "|---|---|---|---|"]
    for v in variants:
        if v.cann is None:
            scope = "any (eager math without torch_npu)" if v.name == "torch-universal" else "any Ascend host"
            rows.append(f"| `{v.name}` | {scope} | | |")
        else:
            rows.append(f"| `{v.name}` | {v.torch} | {v.cann} | {v.cpu} |")
    text = (card.path / "README.md").read_text().rstrip("\n").replace("@VERSION@", str(card.version))
    benchmark = card.path / "benchmark.md"
    if benchmark.exists():
        text += "\n\n## Benchmark\n\n" + benchmark.read_text().rstrip("\n")
    return (
        f"{render_front_matter(card)}\n{text}\n\n{render_models(card)}\n\n## Build variants\n\n"
        "The `kernels` loader takes the variant matching this host's torch, CANN and CPU exactly, "
        "then `torch-npu`, then `torch-universal`.\n\n" + "\n".join(rows) + "\n"
    )


def build_card(card: Card, variants: list[Variant], out_dir: Path) -> Path:
    """Build one card into out_dir/<card.name>, replacing what was there only once it is complete."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / card.name
    staging = Path(tempfile.mkdtemp(prefix=f".{card.name}-", dir=out_dir))
    try:
        (staging / "README.md").write_text(render_readme(card, variants))
        for variant in variants:
            write_variant(card, variant, staging / "build" / variant.name)
        if final.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{card.name}-old-", dir=out_dir))
            final.rename(retired / card.name)
            staging.rename(final)
            shutil.rmtree(retired)
        else:
            staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="output folder (default: build/)")
    parser.add_argument("--cards", default="", help="comma-separated card names (default: all)")
    args = parser.parse_args(argv)
    cards = load_cards([c for c in args.cards.split(",") if c] or None)
    variants = variant_matrix()
    for index, card in enumerate(cards, 1):
        print(f"[{index}/{len(cards)}] {card.name} v{card.version}: {len(variants)} variants ...", end=" ", flush=True)
        path = build_card(card, variants, args.out)
        print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
