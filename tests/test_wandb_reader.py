import pytest

wandb = pytest.importorskip("wandb")

from wandb_reader import find_run_files, iter_records, read_run  # noqa: E402

N_ROWS = 25


def _loss(i: int) -> float:
    return 1.0 / (i + 1) + 0.125


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path


@pytest.fixture
def run_file(wandb_env):
    run = wandb.init(
        mode="offline",
        dir=str(wandb_env),
        project="p",
        group="g",
        tags=["a", "b"],
        config={"x": 1, "nested": {"y": 2}},
    )
    try:
        run.define_metric("train/step")
        run.define_metric("*", step_metric="train/step")
        for i in range(N_ROWS):
            run.log({"train/loss": _loss(i), "train/step": i}, step=i)
        run.config.update({"late": "v"})  # goes to a separate config record
    finally:
        run.finish()
        # as MetricsSink.close: finish() can return before wandb-core has written
        # the file out (seen: a file holding only its header); teardown waits for it
        wandb.teardown()
    files = find_run_files(wandb_env)
    assert len(files) == 1
    assert files[0].parent.name.startswith("offline-run-")
    assert files[0].name == f"run-{run.id}.wandb"
    return files[0]


def test_read_offline_run(run_file):
    data = read_run(run_file)

    history = data["history"]
    assert len(history) == N_ROWS
    for i, row in enumerate(history):
        assert row["_step"] == i
        assert row["train/step"] == i
        assert row["train/loss"] == _loss(i)  # exact: floats round-trip via JSON
        assert {"_runtime", "_timestamp"} <= row.keys()

    config = {k: v for k, v in data["config"].items() if k != "_wandb"}
    assert config == {"x": 1, "nested": {"y": 2}, "late": "v"}

    run = data["run"]
    assert run["project"] == "p"
    assert run["group"] == "g"
    assert run["tags"] == ["a", "b"]
    assert run_file.name == f"run-{run['run_id']}.wandb"

    assert data["summary"]["train/step"] == N_ROWS - 1
    assert data["summary"]["train/loss"] == _loss(N_ROWS - 1)


def test_truncated_file_raises(run_file, tmp_path):
    raw = run_file.read_bytes()
    bad = tmp_path / "run-bad.wandb"
    # cuts inside the file header, a chunk header, the first chunk's data and
    # the last chunk (a cut exactly on a chunk boundary would look valid)
    for cut in (3, 10, 20, len(raw) - 1):
        bad.write_bytes(raw[:cut])
        with pytest.raises(ValueError):
            list(iter_records(bad))
    corrupt = bytearray(raw)
    corrupt[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="crc|chunk|record"):
        read_run(bad)


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, b"\0" * 64])
def test_not_a_wandb_file(tmp_path, content):
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="wandb"):
        read_run(bad)
