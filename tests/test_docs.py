"""The documentation: the site builds strictly, its generated reference follows the code, the metrics page names
every key the runs write, and the README stays a front page whose links resolve."""

from __future__ import annotations

import dataclasses
import gzip
import html
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "docs" / "hooks"
README_LINES = 200
"""The README is a front page; what a user needs beyond it lives in docs/."""

METRIC_PREFIXES = ("charts", "losses", "time", "cpu", "eval", "fleet", "async", "budget", "link", "schedule",
                   "autoencoder", "net", "net_total")


def _page_text(path: Path) -> str:
    """A built page's article as plain text: tags stripped, entities unescaped, whitespace collapsed."""
    page = path.read_text()
    article = page[page.find("<article"):page.rfind("</article>")]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", article)).split())


def _as_shown(help_text: str) -> str:
    """A help text as a page shows it once its tags are stripped: code spans lose their backticks."""
    return " ".join(help_text.replace("`", "").split())


def _settings_fields() -> list[dataclasses.Field]:
    from splitrl.settings import (CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings,
                                  TrainSettings)

    return [f for cls in (TrainSettings, EnvSettings, PPOSettings, CodecSettings, ScheduleSettings, RunOptions)
            for f in dataclasses.fields(cls) if "help" in f.metadata]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return out


def test_the_site_builds_strictly_with_every_section(site: Path):
    for page in ("index.html", "getting-started/index.html", "guides/two-machines/index.html",
                 "concepts/wire/index.html", "reference/cli/index.html", "reference/metrics/index.html",
                 "PROTOCOL/index.html", "benchmarks/index.html", "benchmarks/paper-length/index.html"):
        assert (site / page).is_file(), page
    assert (site / "results/paper-length-report/return.png").is_file(), "the figures the pages show are copied"
    assert not list(site.glob("results/**/*.jsonl")), "the raw run records stay out of the site"


def test_the_cli_reference_holds_every_settings_options_help_and_every_command(site: Path):
    from splitrl.cli import main

    text = _page_text(site / "reference/cli/index.html")
    missing = [f.name for f in _settings_fields() if _as_shown(f.metadata["help"]) not in text]
    assert missing == [], f"settings whose help is not on the generated CLI page: {missing}"

    def commands(group, path):
        for name, cmd in group.commands.items():
            yield f"{path} {name}"
            if hasattr(cmd, "commands"):
                yield from commands(cmd, f"{path} {name}")

    absent = [c for c in commands(main, "splitrl") if c not in text]
    assert absent == [], f"commands missing from the CLI page: {absent}"


def test_the_cli_page_is_rendered_from_the_live_commands(monkeypatch: pytest.MonkeyPatch):
    """Changing an option's help changes the page: nothing is copied or cached between the two."""
    spec = importlib.util.spec_from_file_location("splitrl_docs_reference_hook", HOOKS / "reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    from splitrl.cli import main

    option = next(p for p in main.commands["run"].params if p.name == "num_steps")
    before = reference.cli_markdown()
    assert " ".join(option.help.split()) in before
    monkeypatch.setattr(option, "help", "a help text changed for this test")
    after = reference.cli_markdown()
    assert "a help text changed for this test" in after and after != before


PLACEHOLDERS = ("KIND", "STREAM", "WAY")
"""The words in capitals that stand for a name in the metrics page's keys (``net/KIND/sent_bytes``)."""


def _documented_keys() -> list[re.Pattern[str]]:
    """The keys the metrics page names, as patterns."""
    text = (ROOT / "docs/reference/metrics.md").read_text()
    keys = {span for span in re.findall(r"`([^`\s]+)`", text) if span.split("/")[0] in METRIC_PREFIXES}
    keys |= {"iteration", "global_step"} & set(re.findall(r"`([a-z_]+)`", text))
    split = re.compile("(%s)" % "|".join(PLACEHOLDERS))
    return [re.compile("".join("[A-Za-z0-9_]+" if part in PLACEHOLDERS else re.escape(part)
                               for part in split.split(key)) + "$") for key in keys]


def _recorded_keys() -> set[str]:
    """Every key of every metrics record committed under docs/results."""
    listed = subprocess.run(["git", "ls-files", "docs/results"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    keys: set[str] = set()
    for name in listed:
        if Path(name).name not in ("metrics.jsonl", "metrics.jsonl.gz"):
            continue
        opener = gzip.open if name.endswith(".gz") else open
        with opener(ROOT / name, "rt") as f:
            for line in f:
                if line.strip():
                    keys.update(json.loads(line))
    return keys


def _keys_in_code() -> set[str]:
    """Every literal metric key in the package's code (keys built from a name, like ``time/{phase}``, are left
    to the records)."""
    pattern = re.compile(r"[\"']((?:%s)/[A-Za-z0-9_]+)[\"']" % "|".join(METRIC_PREFIXES))
    return {m for path in (ROOT / "splitrl").rglob("*.py") for m in pattern.findall(path.read_text())}


def test_the_metrics_page_names_every_key_the_runs_write_and_the_code_names():
    documented = _documented_keys()
    recorded, in_code = _recorded_keys(), _keys_in_code()
    assert len(recorded) > 50 and "charts/episodic_return" in recorded, "the committed records were not read"
    undocumented = sorted(k for k in recorded | in_code if not any(p.match(k) for p in documented))
    assert undocumented == [], f"metrics keys missing from docs/reference/metrics.md: {undocumented}"


def test_the_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    links = [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m.group(1)]
    assert links, "no links found"
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue \d+|\bsession \d+", text, re.IGNORECASE), \
        "the README has no dates, issue numbers or work-log"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
