"""The README stays short, every relative link of README.md and docs/*.md lands on a file (and a heading,
where it names one), every docs page is in mkdocs.yml's nav, and the keys table of docs/configs.md is what
docs/gen_keys.py derives from the config models. No network; MkDocs itself only where it is installed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml
from conftest import REPO

DOCS = REPO / "docs"
README_LIMIT = 15_000  # bytes: issue 26 asks for a README under 15 KB
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def prose(path: Path) -> str:
    """The file's text without fenced code blocks and inline code: links and headings there are not ones."""
    return INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path))


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # no scheme: http:, https:, mailto:


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs's toc extension makes it (GitHub's agrees on these pages' headings)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text(encoding="utf-8")), re.M)
    return {slug(heading.replace("`", "")) for heading in headings}


def nav_files(nav: list) -> list[str]:
    found = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found.extend(nav_files(value) if isinstance(value, list) else [value])
    return found


def mkdocs_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))


def test_the_readme_is_under_15_kb():
    size = len((REPO / "README.md").read_bytes())
    assert size < README_LIMIT, f"README.md is {size} bytes: move detail to a docs/ page"


@pytest.mark.parametrize("path", [REPO / "README.md", *pages()], ids=lambda p: p.name)
def test_every_relative_link_lands_on_a_file_and_heading(path):
    broken = []
    for target in filter(relative, links(path)):
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            broken.append(f"{target}: absolute path (breaks on GitHub and in the site)")
            continue
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading #{anchor}")
        elif path.parent == DOCS and DOCS not in dest.parents:
            broken.append(f"{target}: outside docs/, so the site cannot resolve it (name the file in `code`)")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md") if relative(t)}
    unlinked = [p.name for p in pages() if p.name != "index.md" and p.resolve() not in linked]
    assert not unlinked, f"README.md's Documentation list lacks {unlinked}"


def test_the_link_check_sees_links_and_skips_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](x.md) ![img](i.png) `[b](y.md)`\n```\n[c](z.md)\n```\n[d](https://e.org) [f](g.md#h)\n")
    assert links(page) == ["x.md", "https://e.org", "g.md#h"]
    assert [t for t in links(page) if relative(t)] == ["x.md", "g.md#h"]
    assert slug("`normexp verify`".replace("`", "")) == "normexp-verify"
    assert slug("The fast engine's contract") == "the-fast-engines-contract"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = nav_files(mkdocs_config()["nav"])
    on_disk = {p.name for p in pages()}
    assert sorted(set(nav)) == sorted(nav), "a page is in the nav twice"
    assert on_disk - set(nav) == set(), "docs pages missing from mkdocs.yml's nav"
    assert set(nav) - on_disk == set(), "mkdocs.yml's nav names pages that docs/ lacks"


def load_gen_keys():
    spec = importlib.util.spec_from_file_location("gen_keys", DOCS / "gen_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_has_a_meaning_and_no_meaning_is_stale():
    gen = load_gen_keys()
    code = set(gen.keys())
    assert code - set(gen.MEANINGS) == set(), "keys without a meaning: add them to docs/gen_keys.py MEANINGS"
    assert set(gen.MEANINGS) - code == set(), "MEANINGS names keys the config no longer has"


def test_the_keys_table_is_what_the_code_gives():
    gen = load_gen_keys()
    text = (DOCS / "configs.md").read_text(encoding="utf-8")
    assert gen.rewritten(text) == text, "docs/configs.md's keys table is stale: run python docs/gen_keys.py"
    for key, (annotation, default) in gen.keys().items():  # spot the derivation against the models themselves
        assert f"| `{key}` | {gen.describe_type(annotation)} | {gen.describe_default(default)} |" in text


def test_the_keys_table_follows_the_models():
    from normexp.config import NormConfig, ReportConfig, RunConfig

    gen = load_gen_keys()
    found = gen.keys()
    assert [k for k in found if k.startswith("norm.")] == [f"norm.{n}" for n in NormConfig.model_fields]
    assert "seed" in found and len(found) == sum(
        len(type(getattr(RunConfig(), s)).model_fields) for s in ("model", "norm", "data", "optim", "schedule", "train")
    ) + 1 + len(ReportConfig.model_fields)  # + seed, + report.steps/columns/metric/trained_below
    row = gen.describe_type(found["norm.placement"][0])
    from typing import get_args

    from normexp.config import Placement
    assert all(f"`{p}`" in row for p in get_args(Placement))
    assert gen.describe_type(found["optim.lr"][0]) == "float (> 0)"
    assert gen.describe_type(found["data.seq_len"][0]) == "int (>= 2, <= 4_096) or unset"


@pytest.mark.process
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs mkdocs (make install-dev)")
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "configs" / "index.html").exists()


def test_the_sources_page_names_every_registered_placement_and_kind_with_its_paper_and_label():
    """docs/sources.md has a row for each placement and kind of normexp/registry.py, and the registry's
    paper for it is the page's (its first author and year); every kind has a module in NORM_CLASSES."""
    from normexp.models.norms import NORM_CLASSES
    from normexp.registry import KINDS, PLACEMENTS

    page = (REPO / "docs" / "sources.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if line.startswith("| `")}
    for name, method in {**PLACEMENTS, **KINDS}.items():
        assert name in rows, name
        first_author_and_year = " ".join(method.paper.split(",")[0].split()[:1])
        assert first_author_and_year in rows[name] or name in ("none", "rmsnorm_torch"), (name, method.paper)
    assert set(NORM_CLASSES) == set(KINDS)
