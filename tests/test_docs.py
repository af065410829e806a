"""Every relative link in README.md and docs/*.md resolves inside the repository.

A link `[text](target)` (or an image `![alt](target)`) whose target is not a
URL must name a file or folder that exists, relative to the linking file, and
stays inside the repository; an `#anchor` into a Markdown file (or a bare
`#anchor` into the linking file itself) must match a heading there, slugged
the way GitHub does it.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import base_env

REPO = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) or [text](target "title") or [text](<target>); the text may hold `code` and nested [..]
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\"|\s+'[^']*')?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; with `blank_code`, inline
    code spans are blanked out (same length, so `[x](y)` inside code is no link)."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif line.strip().startswith(fence):
                fence = None
            continue
        if fence is None and blank_code:
            lines.append((number, CODE_SPAN.sub(lambda m: m.group(1) + "x" * len(m.group(2)) + m.group(1), line)))
        elif fence is None:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation
    other than '-' and '_' removed, each space turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, ...) and HTML anchors."""
    found, seen = set(), {}
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text, blank_code=False):  # a heading's code spans are part of its anchor
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    found.update(HTML_ANCHOR.findall(text))
    return found


def broken_links(files: list[Path], root: Path) -> list[str]:
    """`file:line: [target] why` for every relative link in `files` that does not resolve."""
    root = root.resolve()
    broken = []
    for source in files:
        text = source.read_text(encoding="utf-8")
        for number, line in prose_lines(text):
            for match in LINK.finditer(line):
                target = match.group(1).strip("<>")
                if SCHEME.match(target):
                    continue  # http(s), mailto: not checked here
                where = f"{source.relative_to(root)}:{number}: ({target})"
                path_part, _, anchor = target.partition("#")
                path = (source.parent / path_part).resolve() if path_part else source.resolve()
                if not path.is_relative_to(root):
                    broken.append(f"{where} points outside the repository")
                elif not path.exists():
                    broken.append(f"{where} does not exist")
                elif anchor and path.suffix == ".md" and path.is_file() and anchor not in anchors(path):
                    broken.append(f"{where} has no heading with the anchor #{anchor} in {path.relative_to(root)}")
    return broken


def test_relative_links_in_readme_and_docs_resolve():
    files = doc_files(REPO)
    assert (REPO / "README.md").is_file()
    broken = broken_links(files, REPO)
    assert not broken, f"{len(broken)} broken link(s) in README.md / docs/*.md:\n" + "\n".join(broken)


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "code.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## What it saves (`bench/x.py`)\n\n## Twice\n\n## Twice\n\nback to [the top](#a-page)\n"
    )
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#what-it-saves-benchxpy) [ok](docs/page.md#twice-1) [ok](code.py)\n"
        "[ok](#title) [`code` ok](docs/) [web](https://example.com/nowhere) [mail](mailto:a@b.c)\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[not a link](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](docs/page.md#nope) [bad self](#nope) [out](../outside.md)\n"
    )
    broken = broken_links(doc_files(tmp_path), tmp_path)
    assert [b.split(": ", 1)[1].split(" ", 1)[0] for b in broken] == [
        "(missing.md)",
        "(docs/page.md#nope)",
        "(#nope)",
        "(../outside.md)",
    ], broken
    assert all(b.startswith("README.md:9: ") for b in broken), broken


# --- the commands the docs tell users to copy -------------------------------------------------

COMMAND_START = re.compile(r"(?:\bpython\s+train\.py\b|\btorchrun\s(?:[^`#]*?\s)?train\.py\b)")
ELLIPSIS = re.compile(r"\.\.\.|…")  # anywhere in a command: something was left out
PLACEHOLDER = re.compile(r"<[^<>]*>|^\[[^\]=]*\]$")  # in an override: a value to fill in


def doc_commands(path: Path, start: re.Pattern = COMMAND_START) -> list[tuple[int, str]]:
    """(line number, command) for every `python train.py ...` / `torchrun ... train.py ...`
    (or what `start` finds) in a Markdown file: in fenced code (a `\\` continuation joins the next line; a
    `$ ` prompt and a `# comment` are dropped) and in inline code spans (which may
    wrap onto the next line of their paragraph). A command ends at `&&`, `;`, `|`,
    `#` or a redirection."""
    text = path.read_text(encoding="utf-8")
    found, fence, pending, paragraph = [], None, None, []

    def add(number: int, snippet: str) -> None:
        match = start.search(snippet)
        if match:
            command = re.split(r"\s(?:&&|;|\||#|\d?>>?(?=\s*[\w/&$]))", " " + snippet[match.start() :])[0]
            if start.search(command):
                found.append((number, " ".join(command.split())))

    def flush_paragraph() -> None:
        starts, joined = [], ""
        for number, line in paragraph:
            starts.append((len(joined), number))
            joined += line + " "
        for match in CODE_SPAN.finditer(joined):
            add(max(n for offset, n in starts if offset <= match.start()), match.group(2))
        paragraph.clear()

    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            flush_paragraph()
            if fence is None:
                fence = match.group(1)
            elif line.strip().startswith(fence):
                fence = None
            continue
        if fence is not None:
            if pending:
                pending = (pending[0], pending[1][:-1] + " " + line.strip())
            else:
                pending = (number, line.strip().removeprefix("$ "))
            if not pending[1].endswith("\\"):
                add(*pending)
                pending = None
        elif line.strip():
            paragraph.append((number, line.strip()))
        else:
            flush_paragraph()
    flush_paragraph()
    return found


# Commands the docs show on purpose as refused (a transcript of the refusal follows them).
REFUSED = {
    "python train.py sharding=full_shard": "README and Configuration show this refusal as the example of `validate`",
}
# Commands that cannot compose here, each with the reason.
NOT_HERE = {
    "python train.py model=wide_mlp": "Configuration's example of a new option: conf/model/wide_mlp.yaml is the file "
    "the reader writes first",
    "python train.py train.profile.enabled=true train.profile.memory_snapshot=true": "GPUs' example of CUDA's "
    "memory snapshot, refused on a machine without CUDA (tests/test_config.py holds the refusal)",
}


def command_jobs(command: str) -> tuple[list[tuple[list[str], int, int]], str | None]:
    """The jobs a documented command runs, each as (overrides, world size, local world size),
    or ([], why) when the command is skipped. See `test_documented_commands_compose_and_validate`."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from harness.config import register_configs

    register_configs()
    tokens = command.split()
    nproc = nnodes = None
    if tokens[0] == "torchrun":
        flags, tokens = tokens[1 : tokens.index("train.py")], tokens[tokens.index("train.py") + 1 :]
        for i, flag in enumerate(flags):
            name, _, value = flag.partition("=")
            value = value or (flags[i + 1] if i + 1 < len(flags) else "")
            if name in ("--nproc-per-node", "--nproc_per_node"):
                nproc = int(value)
            elif name == "--nnodes":
                nnodes = int(value)
        nproc = nproc or 1
    else:
        tokens = tokens[2:]
    multirun = "-m" in tokens or "--multirun" in tokens
    args = [t for t in tokens if not t.startswith("-") and not t.startswith(("hydra.", "hydra/", "+hydra."))]
    if ELLIPSIS.search(command) or any(PLACEHOLDER.search(a) for a in args):
        return [], "placeholder"
    parsed = OverridesParser.create().parse_overrides(args)
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        raise AssertionError(f"{sweeps} sweep(s) without -m: Hydra refuses them")
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        params = compose("config", overrides=plain, return_hydra_config=True).hydra.sweeper.params if multirun else {}
    preset = [f"{key}={value}" for key, value in (params or {}).items()]
    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(preset + args), None)
    jobs = []
    for overrides in batch:
        if nproc is None:  # python train.py: launcher.nproc local ranks (null: 2 without GPUs)
            nprocs = [o.partition("=")[2] for o in overrides if o.startswith("launcher.nproc=")]
            world = int(nprocs[-1]) if nprocs and nprocs[-1] != "null" else 2
            jobs.append((overrides, world, world))
        else:
            jobs.append((overrides, nproc * (nnodes or 1), nproc))
    return jobs, None


def run_documented_prepares(workdir: Path) -> list[str]:
    """Run every `python -m harness.prepare` command that starts a line of the docs (whole, in
    bash, as a user pastes it: its `$(...)` and `\\` continuations kept) in `workdir`, so
    that the training commands that read what it writes validate against real shards."""
    commands = set()
    for path in doc_files(REPO):
        joined = re.sub(r"\\\n\s*", " ", path.read_text(encoding="utf-8"))
        commands.update(re.findall(r"^(?:\$ )?(python -m harness\.prepare .*)$", joined, flags=re.MULTILINE))
    # `python` is this interpreter, as it is in the environment the README sets up
    env = {**base_env(workdir), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in sorted(commands):
        done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"documented command failed: {command}\n{done.stderr[-3000:]}"
    return sorted(commands)


def test_documented_commands_compose_and_validate(tmp_path, monkeypatch):
    """Every `python train.py ...` and `torchrun ... train.py ...` in README.md and
    docs/*.md (fenced code and inline code) composes and passes `validate`, as each
    of its jobs would at startup, on a machine without GPUs.

    - Flags (`-m`, `--cfg ...`) and Hydra's own overrides (`hydra.*`, `hydra/...`) are dropped.
    - A command is skipped as a pattern, not a command, when it holds `...` or `…`
      anywhere (something was left out) or an override holds a placeholder (`<name>`,
      `[overrides]`); a `<host>` in torchrun's own flags does not matter here.
    - `-m` expands the sweep as Hydra's basic sweeper does: the preset's
      `hydra.sweeper.params` first, then the command line (which wins per key),
      the product of every swept value; a sweep without `-m` fails (Hydra refuses it).
    - World size: `torchrun --nproc-per-node N [--nnodes M]` is N·M ranks, N per node;
      `python train.py` starts `launcher.nproc` ranks, 2 when null (no GPUs here).
    - `REFUSED` lists the commands shown on purpose being refused (they must stay
      refused), `NOT_HERE` the ones that cannot compose here, each with its reason.
    - They run in a fresh directory where the documented `python -m harness.prepare`
      commands have run first (4 s), as a user following the docs would have them.
    """
    from hydra import compose, initialize_config_dir

    from harness.config import ConfigError
    from harness.validate import validate

    def check(command: str) -> str | None:
        """Why `command` does not do what the docs say, or None (also when skipped)."""
        overrides: list[str] = []
        try:
            jobs, _ = command_jobs(command)
            for overrides, world, local in jobs:
                with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
                    cfg = compose("config", overrides=overrides)
                try:
                    validate(cfg, world_size=world, gpus=0, local_world_size=local)
                except ConfigError:
                    if command not in REFUSED:
                        raise
                else:
                    if command in REFUSED:
                        raise AssertionError(f"documented as refused, but passes: {REFUSED[command]}")
        except Exception as error:  # noqa: BLE001 - every failure is reported with its command
            return f"job {overrides}: {type(error).__name__}: {error}"
        return None

    assert run_documented_prepares(tmp_path)
    monkeypatch.chdir(tmp_path)
    results: dict[str, str | None] = {}  # each distinct command once
    failures = []
    for path in doc_files(REPO):
        for number, command in doc_commands(path):
            if command not in NOT_HERE:
                if command not in results:
                    results[command] = check(command)
                if results[command]:
                    failures.append(f"{path.relative_to(REPO)}:{number}: {command}\n  {results[command]}")
    assert len(results) > 20
    assert not failures, f"{len(failures)} documented command(s) fail:\n" + "\n".join(failures)


def test_the_command_finder_finds_commands_in_code_blocks_and_spans(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\n$ python train.py a=1 \\\n    b=2   # note\npip install . && python train.py c=3\n"
        "torchrun --nproc-per-node 4 train.py d=4 | tee log\npython -m harness.report x\n"
        "torchrun --rdzv-endpoint <host 0>:29500 train.py g=8 2>/dev/null\n```\n\n"
        "Run `python train.py -m\ne=5,6` or `torchrun ... train.py`; `train.py` alone is no command.\n"
    )
    assert doc_commands(page) == [
        (4, "python train.py a=1 b=2"),
        (6, "python train.py c=3"),
        (7, "torchrun --nproc-per-node 4 train.py d=4"),
        (9, "torchrun --rdzv-endpoint <host 0>:29500 train.py g=8"),
        (12, "python train.py -m e=5,6"),
        (13, "torchrun ... train.py"),
    ]
    jobs, skipped = command_jobs("torchrun --nproc-per-node 4 --nnodes 2 train.py -m averager.period=2,4")
    assert skipped is None and [(j, w, n) for j, w, n in jobs] == [
        (["averager.period=2"], 8, 4),
        (["averager.period=4"], 8, 4),
    ]
    assert command_jobs("python train.py -m ... launcher.nproc=N") == ([], "placeholder")


BENCH_COMMAND = re.compile(r"\bpython\s+bench/[a-z_]+\.py\b")


def test_documented_bench_commands_use_flags_the_benches_define():
    """Every `--flag` of a documented `python bench/<name>.py ...` command (in fenced
    or inline code) is one that bench/<name>.py's argparse defines (read from its
    source, without running it): a renamed flag cannot linger in the docs."""
    wrong, checked = [], 0
    for path in doc_files(REPO):
        for number, command in doc_commands(path, BENCH_COMMAND):
            script = REPO / command.split()[1]
            if not script.is_file():
                wrong.append(f"{path.relative_to(REPO)}:{number}: {command}: {script.name} does not exist")
                continue
            source = script.read_text(encoding="utf-8")
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command):
                checked += 1
                if not re.search(rf"add_argument\(\s*(?:\"-\w\",\s*)?\"{flag}\"", source):
                    wrong.append(f"{path.relative_to(REPO)}:{number}: {command}: {script.name} has no {flag}")
    assert checked > 5
    assert not wrong, "documented bench flags the scripts do not define:\n" + "\n".join(wrong)


# --- metric names -----------------------------------------------------------------------------

METRICS_BEGIN = "<!-- metrics table: python -m harness.metrics -->"
METRICS_END = "<!-- end metrics table -->"


GENERATED = {  # doc: (its markers, the module whose `python -m` prints the table, the function)
    "outputs.md": ((METRICS_BEGIN, METRICS_END), "harness.metrics", "markdown_table"),
    "configuration.md": (("<!-- resume rules: begin -->", "<!-- resume rules: end -->"), "harness.resume", "table"),
}


@pytest.mark.parametrize("doc", sorted(GENERATED))
def test_generated_tables_are_the_generated_ones(doc):
    """docs/outputs.md's metrics table and docs/configuration.md's resume rules between their markers are
    `python -m harness.metrics`'s and `python -m harness.resume`'s output: after changing a Metric in
    harness/metrics.py or a RESUME rule in harness/config.py, paste that output in."""
    (begin, end), module, function = GENERATED[doc]
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    assert text.count(begin) == 1 and text.count(end) == 1, f"docs/{doc}'s table markers are missing"
    table = text.split(begin)[1].split(end)[0]
    assert table.strip("\n") == getattr(importlib.import_module(module), function)().strip("\n"), (
        f"docs/{doc}'s table differs from {module}: replace the lines between {begin} and {end} by the output of "
        f"`python -m {module}`"
    )


def test_every_metric_named_in_the_docs_is_declared():
    """Every `section/name` in inline code in README.md and docs/*.md whose section
    is a metric section (`train/...`, `comm/...`, ...) is declared in
    harness.metrics.METRICS, so a renamed metric cannot linger in prose. Wildcards
    (`comm/*`, `checkpoint/*_s`) and config groups (`averager/outer_optimizer`, a
    folder under conf/) are not metric names."""
    from harness.metrics import METRICS

    sections = {name.split("/")[0] for name in METRICS}
    unknown = []
    for path in doc_files(REPO):
        for number, line in prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
            for match in CODE_SPAN.finditer(line):
                name = match.group(2).strip()
                if (
                    re.fullmatch(r"[a-z_]+/[a-z0-9_]+", name)
                    and name.split("/")[0] in sections
                    and name not in METRICS
                    and not (REPO / "conf" / name).is_dir()
                ):
                    unknown.append(f"{path.relative_to(REPO)}:{number}: `{name}`")
    assert not unknown, "metric names in the docs that harness/metrics.py does not declare:\n" + "\n".join(unknown)


def test_the_checkpoint_parts_tables_name_every_part_of_a_job():
    """docs/design.md's parts table and docs/checkpoints.md's meta.json row name
    exactly the parts `Job.checkpoint_parts()` returns (called on a stand-in job:
    it only reads the attributes)."""
    from types import SimpleNamespace

    from harness.job import Job

    parts = set(Job.checkpoint_parts(SimpleNamespace(clock=0, data=0, cross_replica=0, lr_schedule=0)))
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    table = design.split("## A checkpoint is a set of named stateful parts")[1].split("\n\n")[2]
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    named = {row.strip("`") for row in rows if row.startswith("`")} - {"model", "optim"}
    assert named == parts, f"docs/design.md's parts table names {sorted(named)}; the job's parts: {sorted(parts)}"
    checkpoints = (REPO / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    meta_row = next(line for line in checkpoints.splitlines() if line.startswith("| `meta.json` |"))
    missing = [part for part in sorted(parts) if f"`{part}`:" not in meta_row]
    assert not missing, f"docs/checkpoints.md's meta.json row does not describe the parts {missing}"


FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?(×|%)")


def unquoted_figures(readme: str, docs: Path) -> list[str]:
    """The ratios and percentages a bullet of README's tour gives that none of the pages it links to
    measures (a page's figure rounded to the bullet's decimals counts): the README quotes, the pages measure."""
    tour = readme[readme.index("## A short tour") : readme.index("## Docs")]
    missing = []
    for bullet in tour.split("\n- ")[1:]:
        pages = {link.split("#")[0] for link in re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#[\w-]+)?\)", bullet)}
        measured = [m.groups() for page in pages for m in FIGURE.finditer((docs.parent / page).read_text())]
        for value, unit in (m.groups() for m in FIGURE.finditer(bullet)):
            decimals = len(value.partition(".")[2])
            if not any(u == unit and round(float(v), decimals) == float(value) for v, u in measured):
                missing.append(f"{value}{unit} ({bullet.split('**')[1] if '**' in bullet else bullet[:30]})")
    return missing


def test_the_readme_quotes_figures_its_linked_pages_measure(tmp_path):
    assert unquoted_figures((REPO / "README.md").read_text(), REPO / "docs") == []
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("in **0.55×** the time, +0.08 % loss")
    stale = "## A short tour\n\n- **Uneven.** 0.52× the time, 0.8 % lower ([B](docs/b.md#x)); 0.6×\n\n## Docs\n"
    assert unquoted_figures(stale, tmp_path / "docs") == ["0.52× (Uneven.)", "0.8% (Uneven.)"]


def test_the_design_layout_names_every_module():
    layout = (REPO / "docs" / "design.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    modules = [p for p in sorted((REPO / "harness").rglob("*.py")) if p.name != "__init__.py"]
    assert [str(p.relative_to(REPO)) for p in modules if p.name not in layout] == []
