"""Every code block of README.md and docs/ runs here, or is marked as not runnable with the reason.

So a recipe cannot drift from what it does. The rules, per fenced block:

- ```python: the blocks of one file run in order in one namespace (a later block may use an earlier
  one's names), in a temporary working directory. For the run ``lightning.pytorch.Trainer`` is a
  subclass that caps every fit at 12 optimizer steps on the CPU, logging every 4, without a progress
  bar or model summary; a ``trainer`` a block leaves is then fitted on a tiny, healthy classifier
  (:class:`TinyClassifier`, 16 batches of 4 an epoch) and must have run its 12 steps, logged a tag of
  each trainvitals callback it holds, and found nothing wrong with the graph. Rules a block registers
  for per-example gradients are unregistered afterwards.
- ```bash: the README's two setup commands (install and demo; install and tests) are what CI runs
  itself: ``.ci/run`` installs the project the way they say and runs the same pytest command, checked
  below. Every other bash block is marked.
- ```text: program output or a diagram, not code. The README's demo output is checked against the
  labels :func:`trainvitals.demo.run.format_summary` prints.
- A block is marked as not runnable by an HTML comment ``<!-- not run: why -->`` on the line before
  its fence. Any other fence (no language, another language) fails the test, and so does an indented
  code block (four spaces after a blank line), which would escape these rules.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainvitals.per_example import registered_types, unregister_per_example_rule

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FIT_STEPS = 12
NOT_RUN = re.compile(r"^<!-- not run: (\S.*) -->$")

# One tag each trainvitals callback logs within the capped fit.
TAG_OF = {
    "GradNormMonitor": "grad_norm/total",
    "GradNormEarlyStopping": "grad_norm/band_streak",
    "BatchVarianceProbe": "grad_noise/trace_cov",
    "LRScalingAdvisor": "lr_scaling/effective_batch",
    "MemoryTopologyProfiler": "memory/activations_bytes",
}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, from 1
    language: str
    code: str
    not_run: str | None  # the reason, for a marked block

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.language or 'no language'})"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with the marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, language = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            marker = NOT_RUN.match(lines[start - 1].strip()) if start else None
            code = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Block(path, start + 1, language, code, marker.group(1) if marker else None))
            i = end
        i += 1
    return found


def readme_commands() -> tuple[str, str]:
    """The README's two setup commands: install and demo, install and tests."""
    bash = [b.code.strip() for b in blocks(ROOT / "README.md") if b.language == "bash" and b.not_run is None]
    demo = [c for c in bash if c.endswith("trainvitals demo")]
    tests = [c for c in bash if c.endswith("python -m pytest -q")]
    assert len(demo) == 1 and len(tests) == 1 and len(bash) == 2, bash
    return demo[0], tests[0]


class TinyClassifier(pl.LightningModule):
    """3 classes from 8 features: a healthy model every trainvitals callback can measure."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def tiny_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=4)


class CappedTrainer(pl.Trainer):
    """The Trainer a block builds, capped at :data:`FIT_STEPS` optimizer steps on the CPU."""

    def __init__(self, **kwargs) -> None:
        kwargs["max_steps"] = FIT_STEPS
        for name, value in {
            "accelerator": "cpu",
            "devices": 1,
            "log_every_n_steps": 4,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }.items():
            kwargs.setdefault(name, value)
        super().__init__(**kwargs)


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working directory to write into, the capped Trainer, and the per-example registry put back."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pl, "Trainer", CappedTrainer)
    before = set(registered_types())
    yield
    unregister_per_example_rule(*(set(registered_types()) - before))


def fit_and_check(trainer: pl.Trainer) -> None:
    pl.seed_everything(0, verbose=False)
    trainer.fit(TinyClassifier(), tiny_loader())
    assert trainer.global_step == FIT_STEPS
    names = {type(cb).__name__: cb for cb in trainer.callbacks}
    for name, tag in TAG_OF.items():
        if name in names:
            assert tag in trainer.callback_metrics, (name, tag, sorted(trainer.callback_metrics))
    if "GraphIntegrityCallback" in names:
        assert names["GraphIntegrityCallback"].findings == []


def indented_blocks(path: Path) -> list[int]:
    """Lines (from 1) that open an indented code block: four spaces after a blank line, outside fences."""
    found, fenced, previous = [], False, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not previous.strip() and re.match(r"    [^ \-*]", line):
            found.append(number)
        previous = line
    return found


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_runnable_text_or_marked(path: Path) -> None:
    assert not indented_blocks(path), "indented code blocks: fence them"
    setup = set(readme_commands())
    for block in blocks(path):
        assert block.language in {"python", "bash", "text"}, f"{block}: fence without a known language"
        if block.language == "bash" and block.not_run is None:
            assert block.code.strip() in setup, f"{block}: a bash block that is not a setup command is marked"


@pytest.mark.parametrize(
    "path",
    [p for p in PAGES if any(b.language == "python" and b.not_run is None for b in blocks(p))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_python_blocks_run(path: Path, sandbox) -> None:
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for block in blocks(path):
        if block.language != "python" or block.not_run is not None:
            continue
        namespace.pop("trainer", None)
        exec(compile(block.code, str(block), "exec"), namespace)  # noqa: S102 - the docs' own code
        if isinstance(namespace.get("trainer"), pl.Trainer):
            fit_and_check(namespace["trainer"])


def test_ci_installs_and_tests_as_the_readme_says() -> None:
    demo, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # The two commands differ only in the extra and in what they run after installing.
    assert demo.replace('".[examples]"', '".[dev]"').removesuffix("trainvitals demo") == tests.removesuffix(
        "python -m pytest -q"
    )
    assert 'pip install -q -e ".[dev]"' in ci and "pip install torch==2.13.0" in tests
    assert "python -m pytest -q" in ci.splitlines()[-1]
    for check in ("ruff check .", "ruff format --check .", "mkdocs build --strict"):
        assert check in ci
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'trainvitals = "trainvitals.cli:main"' in pyproject and re.search(r"^examples = \[", pyproject, re.M)


def test_the_readme_shows_what_the_demo_prints() -> None:
    from trainvitals.demo.run import DemoResult, format_summary

    (shown,) = [b.code for b in blocks(ROOT / "README.md") if b.language == "text"]
    result = DemoResult(1, 1, "stopped", 0.1, 0.1, 1.0, 1.1, 0.9, "runs/digits/version_0", 1.0, 1, {})
    printed = format_summary(result, "runs", details=False)

    def labels(text: str) -> list[str]:
        return [line.split(":")[0] for line in text.splitlines()]

    assert labels(shown) == labels(printed)
    look = "tensorboard --logdir runs   or   trainvitals report runs --format html --output report.html"
    assert look in shown and look in printed


def test_the_snippets_shown_are_the_ones_test_recipes_runs() -> None:
    """The Use snippet (README, docs/index.md) and the Lightning recipes (the noise band's page) are the text
    that tests/test_recipes.py runs and checks: an edit to one side alone fails here."""
    from test_recipes import RECIPES, USE

    for page, snippet in [
        ("README.md", USE),
        ("docs/index.md", USE),
        ("docs/callbacks/noise-band-stopping.md", RECIPES),
    ]:
        shown = [b.code for b in blocks(ROOT / page) if b.language == "python" and b.not_run is None]
        assert snippet.lstrip("\n") in shown, page


def test_the_demo_options_shown_are_its_defaults() -> None:
    import argparse

    from trainvitals.demo.options import add_arguments

    (command,) = [b.code for b in blocks(ROOT / "docs" / "demo.md") if b.language == "bash"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = shlex.split(command)
    assert words[:2] == ["trainvitals", "demo"]
    assert parser.parse_args(words[2:]) == parser.parse_args([])


def test_the_readme_links_to_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing


def test_the_docs_hook_shows_sphinx_roles_as_code() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("sphinx_roles", ROOT / "docs" / "hooks" / "sphinx_roles.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    html = "the run's one :class:<code>~trainvitals.noise.estimate.GradientNoise</code>, see :mod:<code>.gsnr</code>"
    assert hook.on_page_content(html) == "the run's one <code>GradientNoise</code>, see <code>.gsnr</code>"
