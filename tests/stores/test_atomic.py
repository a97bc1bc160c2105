"""Atomic store folders: a process killed at any step leaves the old or the new state.

The crash tests run a small "zygote" process that imports everything once and then, for
k = 1, 2, ..., forks a child that sets a store up, arms a counter on every file-system
step (mkdir, fsync, rename, replace, symlink, unlink, rmdir) and kills itself with
SIGKILL just before step k. The first child that finishes without dying ends the loop.
This test then reopens every store: each must hold the old or the new complete state
(never none, never an error), and reopening must clean every leftover.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tailrace.errors import StoreError
from tailrace.stores.atomic import current, replace_dir

ZYGOTE = r"""
import os, signal, sys

root = sys.argv[1]
exec(sys.stdin.read())  # the scenario: setup(folder, ack) and change(folder, ack)

armed_at, done, log = 0, 0, None


def counted(name):
    real = getattr(os, name)

    def step(*args, **kwargs):
        global done
        if armed_at:
            done += 1
            log.write(f"{name} {os.path.basename(str(args[0]))}\n")
            log.flush()
            if done == armed_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(os, name, step)


for name in ("mkdir", "fsync", "rename", "replace", "symlink", "unlink", "rmdir"):
    counted(name)

for k in range(1, 400):
    folder = os.path.join(root, f"k{k:03d}")
    os.makedirs(folder)
    pid = os.fork()
    if pid == 0:
        with open(folder + ".acked", "a") as acked:
            def ack(line):
                acked.write(line + "\n")
                acked.flush()
            setup(folder, ack)
            log = open(folder + ".steps", "w")
            armed_at = k
            change(folder, ack)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        break
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        sys.exit(f"child {k} ended with status {status}")
"""


def crash_at_every_step(tmp_path: Path, scenario: str) -> list[tuple[Path, str]]:
    """Run ``scenario`` once per step, killed before it; (folder, step it died at) each.

    The last entry is the run that finished (its step is "finished").
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ZYGOTE, str(tmp_path)],
                          input=textwrap.dedent(scenario), text=True, capture_output=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs = []
    for folder in sorted(p for p in tmp_path.iterdir() if p.is_dir()):
        steps = Path(f"{folder}.steps").read_text().splitlines()
        runs.append((folder, steps[-1] if steps else "none"))
    *killed, (last, _) = runs
    assert len(Path(f"{last}.steps").read_text().splitlines()) == len(killed)
    return [*killed, (last, "finished")]


def acked(folder: Path) -> list[str]:
    return Path(f"{folder}.acked").read_text().splitlines()


def assert_old_then_new(states: list[str], old: str, new: str) -> None:
    """Every run found the old or the new state; once new, always new (k grows)."""
    switch = states.index(new)
    assert switch > 0 and states == [old] * switch + [new] * (len(states) - switch), states


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- the folder swap itself -----------------------------------------------------------
SWAP = """
from pathlib import Path
from tailrace.stores.atomic import replace_dir


def write(folder, text):
    with replace_dir(Path(folder) / "store") as tmp:
        (tmp / "meta.json").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "data").write_text(text * 3)


def setup(folder, ack):
    {setup}


def change(folder, ack):
    write(folder, "new")
"""
VERSIONED = "write(folder, 'old')"
OLD_LAYOUT = """(Path(folder) / "store" / "sub").mkdir(parents=True)
    (Path(folder) / "store" / "meta.json").write_text("old")
    (Path(folder) / "store" / "sub" / "data").write_text("oldoldold")"""


@pytest.mark.parametrize("layout", [VERSIONED, OLD_LAYOUT], ids=["versioned", "old-layout"])
def test_a_kill_at_any_step_of_a_swap_leaves_the_old_or_the_new_folder(tmp_path, layout):
    runs = crash_at_every_step(tmp_path, SWAP.format(setup=layout))
    states = []
    for folder, _step in runs:
        found = current(folder / "store")
        assert found is not None
        text = (found / "meta.json").read_text()
        assert (found / "sub" / "data").read_text() == text * 3
        assert (folder / "store" / "meta.json").read_text() == text  # through the link
        assert sorted(os.listdir(folder)) == ["store", found.name]  # leftovers removed
        assert os.readlink(folder / "store") == found.name
        states.append(text)
    assert_old_then_new(states, "old", "new")
    died_at = {step.split()[0] for _, step in runs}
    assert {"fsync", "rename", "symlink", "replace", "unlink", "rmdir"} <= died_at


def test_writes_keep_one_version_and_no_leftovers(tmp_path):
    store = tmp_path / "store"
    assert current(store) is None
    for text in ("a", "b", "c"):
        with replace_dir(store) as tmp:
            (tmp / "meta.json").write_text(text)
    assert (store / "meta.json").read_text() == "c"
    assert sorted(os.listdir(tmp_path)) == ["store", "store.v000003"]
    assert current(store) == tmp_path / "store.v000003"


def test_a_failed_write_keeps_the_old_version_and_leaves_nothing(tmp_path):
    store = tmp_path / "store"
    with replace_dir(store) as tmp:
        (tmp / "meta.json").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), replace_dir(store) as tmp:
        (tmp / "meta.json").write_text("half")
        raise RuntimeError("boom")
    assert (store / "meta.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["store", "store.v000001"]


def test_a_link_to_a_missing_version_is_an_error_naming_it(tmp_path):
    store = tmp_path / "store"
    with replace_dir(store) as tmp:
        (tmp / "meta.json").write_text("x")
    os.rename(tmp_path / "store.v000001", tmp_path / "elsewhere")
    with pytest.raises(StoreError, match=rf"^{store} points to {tmp_path}/store.v000001, "
                       r"which is missing; restore that folder, or remove .* to start over$"):
        current(store)
    with replace_dir(store) as tmp:  # a writer replaces the damaged link
        (tmp / "meta.json").write_text("y")
    assert (store / "meta.json").read_text() == "y"


def test_a_file_in_place_of_the_store_is_an_error(tmp_path):
    (tmp_path / "store").write_text("not a folder")
    with pytest.raises(StoreError, match=r"store is a file, not a store folder .*move it away"):
        current(tmp_path / "store")


def test_the_old_layouts_folder_becomes_a_version_on_open(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "meta.json").write_text("legacy")
    found = current(store)
    assert found == tmp_path / "store.v000001" and store.is_symlink()
    assert (store / "meta.json").read_text() == "legacy"


def test_a_crash_between_the_old_layouts_two_renames_is_rescued(tmp_path):
    (tmp_path / ".store.old-k2j4h1x0").mkdir()  # the old swap moved the old folder aside
    (tmp_path / ".store.old-k2j4h1x0" / "meta.json").write_text("old")
    (tmp_path / ".store.tmp-k2j4h1x0").mkdir()  # ... and died before moving the new in
    found = current(tmp_path / "store")
    assert found is not None and (found / "meta.json").read_text() == "old"
    assert hidden(tmp_path) == []


def test_a_folder_without_the_marker_is_read_as_is_and_never_replaced(tmp_path):
    mine = tmp_path / "store"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    assert current(mine) == mine  # not moved: it is not a store of ours
    with pytest.raises(StoreError, match="store is a folder without meta.json, not a store"), \
            replace_dir(mine):
        pass
    assert (mine / "notes.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_a_users_own_link_is_read_through_and_its_folder_kept(tmp_path):
    (tmp_path / "big-disk").mkdir()
    (tmp_path / "big-disk" / "meta.json").write_text("there")
    (tmp_path / "store").symlink_to(tmp_path / "big-disk")
    assert current(tmp_path / "store") == tmp_path / "store"
    with replace_dir(tmp_path / "store") as tmp:
        (tmp / "meta.json").write_text("here")
    assert (tmp_path / "store" / "meta.json").read_text() == "here"
    assert (tmp_path / "big-disk" / "meta.json").read_text() == "there"


def test_only_the_leftovers_of_writers_that_are_gone_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        with replace_dir(tmp_path / "store") as tmp:
            (tmp / "meta.json").write_text("x")
        (tmp_path / f".store.tmp-{dead_pid}-00ff").mkdir()
        (tmp_path / f".store.link-{dead_pid}-00fe").symlink_to("store.v000001")
        (tmp_path / f".store.tmp-{alive.pid}-0aaa").mkdir()  # still writing
        (tmp_path / f".other.tmp-{dead_pid}-00ff").mkdir()  # another store's
        current(tmp_path / "store")
        assert hidden(tmp_path) == [f".other.tmp-{dead_pid}-00ff", f".store.tmp-{alive.pid}-0aaa"]
    finally:
        alive.communicate(b"")
    current(tmp_path / "store")
    assert hidden(tmp_path) == [f".other.tmp-{dead_pid}-00ff"]


# -- the stores that use it -----------------------------------------------------------
VECTOR = """
import numpy as np
from tailrace.stores.vector_index import VectorIndex


def save(folder, n):
    v = np.random.default_rng(0).standard_normal((n, 16)).astype(np.float32)
    index = VectorIndex.create(16, model="m")
    index.add(v / np.linalg.norm(v, axis=1, keepdims=True), [{"n": i} for i in range(n)])
    index.save(folder + "/idx", fingerprint=str(n))


def setup(folder, ack):
    save(folder, 4)


def change(folder, ack):
    save(folder, 9)
"""


def test_a_kill_at_any_step_of_a_vector_index_save_leaves_the_old_or_the_new(tmp_path):
    pytest.importorskip("faiss")
    from tailrace.stores.vector_index import VectorIndex

    runs = crash_at_every_step(tmp_path, VECTOR)
    states = []
    for folder, _step in runs:
        index = VectorIndex.open(folder / "idx")  # never "no index", never corrupt
        assert index.fingerprint == str(len(index))
        assert [d["n"] for d in index.docs] == list(range(len(index)))
        states.append(str(len(index)))
    assert_old_then_new(states, "4", "9")
    for folder, step in runs:  # opening cleaned up: the link and its version, nothing else
        assert hidden(folder) == [] and len(os.listdir(folder)) == 2, step


LIVE = """
import numpy as np
from tailrace.stores.live_index import LiveIndex


def put(index, ids, ack):
    v = np.stack([np.random.default_rng(i).standard_normal(8) for i in ids]).astype(np.float32)
    index.upsert([f"d{i}" for i in ids], v / np.linalg.norm(v, axis=1, keepdims=True),
                 [{"id": f"d{i}"} for i in ids])
    for i in ids:  # upsert returned: these documents are acknowledged
        ack(f"+d{i}")


def setup(folder, ack):
    global index
    index = LiveIndex(folder + "/live")
    index.snapshot_every_s = None
    put(index, range(0, 6), ack)
    index.snapshot()                      # the old snapshot: d0..d5
    put(index, range(6, 10), ack)         # only in the log
    index.delete(["d1"])
    ack("-d1")


def change(folder, ack):
    index.snapshot()                      # killed at each of its steps ...
    put(index, range(10, 13), ack)
    index.close()                         # ... and of the final snapshot's
"""


def test_a_kill_mid_snapshot_loses_no_acknowledged_live_document(tmp_path):
    pytest.importorskip("faiss")
    np = pytest.importorskip("numpy")
    from tailrace.stores.live_index import LiveIndex

    runs = crash_at_every_step(tmp_path, LIVE)
    for folder, step in runs:
        want: set[str] = set()
        for line in acked(folder):
            (want.add if line[0] == "+" else want.discard)(line[1:])
        index = LiveIndex(folder / "live")
        try:
            held = {f"d{i}" for i in range(13) if f"d{i}" in index}
            assert held == want, step
            for doc_id in want:  # the vectors came back too
                q = np.random.default_rng(int(doc_id[1:])).standard_normal(8)
                q = (q / np.linalg.norm(q)).astype(np.float32)
                assert index.search(q, 1)[0][0]["id"] == doc_id
        finally:
            index.close()
        meta = json.loads((folder / "live" / "snapshot" / "meta.json").read_text())
        assert meta["count"] == len(want)
    for folder, step in runs:  # opening and closing cleaned up: no old version, no old log
        live = folder / "live"
        assert sorted(os.listdir(live)) == ["snapshot", os.readlink(live / "snapshot"),
                                            "wal.jsonl"], step
    died_at = [step for _, step in runs]
    assert any(s.startswith("replace wal.jsonl") for s in died_at)  # retiring the log
    assert any(s.startswith("replace .snapshot.link-") for s in died_at)  # the switch
    assert any(s.startswith("unlink wal-") for s in died_at)  # deleting the retired log


def test_a_live_index_with_a_damaged_snapshot_refuses_to_start_empty(tmp_path):
    pytest.importorskip("faiss")
    np = pytest.importorskip("numpy")
    from tailrace.stores.live_index import LiveIndex

    index = LiveIndex(tmp_path)
    index.upsert(["a"], np.eye(1, 4, dtype=np.float32), [{"id": "a"}])
    index.close()
    version = tmp_path / os.readlink(tmp_path / "snapshot")
    (version / "meta.json").unlink()
    with pytest.raises(StoreError, match=rf"snapshot at {version} is corrupt"):
        LiveIndex(tmp_path)
    for f in version.iterdir():
        f.unlink()
    version.rmdir()
    with pytest.raises(StoreError, match=rf"points to {version}, which is missing"):
        LiveIndex(tmp_path)


def test_a_live_index_of_the_old_layout_opens_and_moves_to_versions(tmp_path):
    pytest.importorskip("faiss")
    np = pytest.importorskip("numpy")
    from tailrace.stores.live_index import LiveIndex

    index = LiveIndex(tmp_path)
    index.upsert(["a", "b"], np.eye(2, 4, dtype=np.float32), [{"id": "a"}, {"id": "b"}])
    index.close()
    version = os.readlink(tmp_path / "snapshot")  # make it a plain snapshot/ folder
    (tmp_path / "snapshot").unlink()
    os.rename(tmp_path / version, tmp_path / "snapshot")
    again = LiveIndex(tmp_path)
    assert len(again) == 2 and "a" in again and (tmp_path / "snapshot").is_symlink()
    again.close()


def test_zygote_children_really_die_by_sigkill(tmp_path):
    """The harness itself: a scenario that never finishes would fail, not pass."""
    scenario = """
    import os, signal
    def setup(folder, ack):
        pass
    def change(folder, ack):
        os.kill(os.getpid(), signal.SIGTERM)
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ZYGOTE, str(tmp_path)],
                          input=textwrap.dedent(scenario), text=True, capture_output=True,
                          env=env, timeout=60)
    assert proc.returncode != 0 and f"status {int(signal.SIGTERM)}" in proc.stderr
