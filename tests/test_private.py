"""The private files: the data dir 0700, the store and the admin token 0600, whatever the umask."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys

import pytest

from bili_addon import private
from bili_addon.launch import doctor_checks
from bili_addon.store import Store, StoreError


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_token_is_made_once_private_and_kept(tmp_path, umask022):
    data = tmp_path / "a" / "data"
    token = private.ensure_token(data)
    assert len(token) >= 40 and private.ensure_token(data) == token == private.read_token(data)
    assert mode(data) == 0o700 and mode(data / "admin-token") == 0o600
    assert mode(tmp_path / "a") == 0o755  # only bili's own directory is made private
    os.chmod(data / "admin-token", 0o644)
    assert private.ensure_token(data) == token and mode(data / "admin-token") == 0o600
    (data / "admin-token").write_text("")  # emptied by hand: a new one
    fresh = private.ensure_token(data)
    assert fresh and fresh != token
    assert sorted(os.listdir(data)) == ["admin-token"]  # no temporary file left


def test_racing_processes_agree_on_one_token(tmp_path):
    data = tmp_path / "data"
    code = "import sys; from bili_addon import private; print(private.ensure_token(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(data)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    tokens = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert tokens == {private.read_token(data)}


def test_a_directory_that_is_not_bili_s_is_left_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    (shared / "someone-elses.txt").write_text("x")
    os.chmod(shared, 0o755)
    assert private.private_dir(shared) is False and mode(shared) == 0o755
    sticky = tmp_path / "tmp-like"  # shared on purpose: left as it is, and not used (others may write it)
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    with pytest.raises(private.NotPrivate, match="writable by other users"):
        private.private_dir(sticky)
    assert mode(sticky) == 0o1777
    (shared / "room").mkdir()
    os.chmod(shared / "room", 0o777)
    (shared / "room" / "notes.txt").write_text("x")
    with pytest.raises(private.NotPrivate, match="writable by other users"):
        private.private_dir(shared / "room")
    old = tmp_path / "old-bili"
    old.mkdir()
    (old / "bili.sqlite3").write_text("")
    os.chmod(old, 0o755)
    assert private.private_dir(old) is True and mode(old) == 0o700


def test_an_old_store_is_tightened_and_reported(tmp_path, umask022):
    data = tmp_path / "data"
    Store(data).close()
    os.chmod(data, 0o755)
    os.chmod(data / "bili.sqlite3", 0o644)
    s = Store(data)
    try:
        assert s.tightened == [str(data), str(data / "bili.sqlite3")]
        assert mode(data) == 0o700 and mode(data / "bili.sqlite3") == 0o600
        for wal in ("bili.sqlite3-wal", "bili.sqlite3-shm"):
            if (data / wal).exists():
                assert mode(data / wal) == 0o600
    finally:
        s.close()
    again = Store(data)
    assert again.tightened == []
    again.close()


@pytest.fixture
def stranger(monkeypatch):
    """``stranger(path)``: ``path`` (and what is under it) becomes another user's (nobody's, as root;
    else this process stops being its owner: bili's checks see another user either way)."""
    def make(path):
        if os.geteuid() == 0:
            for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
                os.lchown(p, 65534, 65534)
        else:
            monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    return make


def plant(folder) -> None:
    """What another user leaves where the victim's data dir will be: a world-writable directory, a
    token it knows and an empty store file anyone may write."""
    old = os.umask(0)
    try:
        folder.mkdir(mode=0o777)
        (folder / "admin-token").write_text("planted-token\n")
        (folder / "bili.sqlite3").write_bytes(b"")
        for f in ("admin-token", "bili.sqlite3"):
            os.chmod(folder / f, 0o666)
    finally:
        os.umask(old)


def test_a_data_dir_another_user_made_is_refused(tmp_path, stranger):
    """A shared place (--data-dir /tmp/bili) someone reached first: its token is not trusted, its
    store file is not opened (the conversations never go into it), and the refusal names the owner."""
    data = tmp_path / "bili"
    plant(data)
    stranger(data)
    assert private.read_token(data) is None
    with pytest.raises(private.NotPrivate, match=f"{data} belongs to .*, not to this user"):
        private.ensure_token(data)
    with pytest.raises(StoreError) as e:
        Store(data)
    assert e.value.kind == "not private" and f"{data} belongs to" in str(e.value), e.value
    assert "belongs to" in (private.refusal(data) or "")
    assert sorted(os.listdir(data)) == ["admin-token", "bili.sqlite3"]  # nothing written there
    assert (data / "bili.sqlite3").read_bytes() == b"" and mode(data) == 0o777
    args = argparse.Namespace(confdir=str(tmp_path / "conf"), data_dir=str(data), port=1, store="")
    check = {c.name: c for c in doctor_checks(args, env={"PATH": ""})}["data dir"]
    assert not check.ok and check.required and f"{data} belongs to" in check.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's file in a directory of our own: made as root")
@pytest.mark.parametrize("name", ["admin-token", "bili.sqlite3", "bili.sqlite3-wal", "bili.sqlite3-shm"])
def test_another_user_s_file_in_our_data_dir_is_refused(tmp_path, name):
    """A token or store file of another user (left from a time the data dir was open to them) is
    neither trusted nor written to: the token is not read, the store does not open."""
    data = tmp_path / "data"
    Store(data).close()
    private.ensure_token(data)
    (data / name).unlink(missing_ok=True)
    (data / name).write_bytes(b"planted-token\n" if name == "admin-token" else b"")
    os.chmod(data / name, 0o666)
    os.chown(data / name, 65534, 65534)
    if name == "admin-token":
        assert private.read_token(data) is None
        with pytest.raises(private.NotPrivate, match=f"{data / name} belongs to"):
            private.ensure_token(data)
    else:
        with pytest.raises(StoreError, match=f"{data / name} belongs to"):
            Store(data)
        assert (data / name).read_bytes() == b""
    assert mode(data / name) == 0o666 and f"{data / name} belongs to" in (private.refusal(data) or "")


@pytest.mark.parametrize("name", ["admin-token", "bili.sqlite3", "bili.sqlite3-wal"])
def test_a_link_in_the_data_dir_is_not_followed(tmp_path, name):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    Store(data).close()
    private.ensure_token(data)
    elsewhere.write_bytes(b"planted-token\n")
    (data / name).unlink(missing_ok=True)
    (data / name).symlink_to(elsewhere)
    if name == "admin-token":
        assert private.read_token(data) is None
        with pytest.raises(private.NotPrivate, match="is a link"):
            private.ensure_token(data)
    else:
        with pytest.raises(StoreError, match="is a link"):
            Store(data)
    assert elsewhere.read_bytes() == b"planted-token\n"
    assert "is a link" in (private.refusal(data) or "")


@pytest.mark.parametrize("headers,want", [
    ({"x-bili-token": " abc "}, "abc"),
    ({"authorization": "Bearer abc"}, "abc"),
    ({"authorization": "bearer abc"}, "abc"),
    ({"authorization": "Basic abc"}, ""),
    ({}, ""),
])
def test_the_token_a_request_carries(headers, want):
    assert private.presented_token(headers) == want
    assert private.token_matches(want, "abc") is bool(want)
    assert private.token_matches("abc", None) is False


def test_the_export_folder_never_leads_outside_the_data_dir(tmp_path):
    """A link planted where the session's export folder goes (by the model through the agent's shell,
    say) is refused: decompress says so and writes nothing."""
    from bili_addon.kernel.fold import Block
    from bili_addon.kernel.surfaces import decompress
    from bili_addon.kernel.tools import export_dir

    data, outside = tmp_path / "data", tmp_path / "home"
    outside.mkdir()
    folder = export_dir(data, "sess/../../x")
    assert folder.parent == data / "exports" and ".." not in folder.name
    assert mode(folder) == 0o700 and mode(folder.parent) == 0o700
    folder.rmdir()
    folder.symlink_to(outside)
    with pytest.raises(OSError):
        export_dir(data, "sess/../../x")
    block = Block("b1", 1, "a summary", "topic", ["m00001"], ["m00001"], [], "m00001", "m00001")
    rows = lambda refs: [("m00001", "user", "text", "", "", "the original text", 3)]  # noqa: E731
    text = decompress({"blockId": "b1", "toFile": True}, [block], rows, lambda: export_dir(data, "sess/../../x"))
    assert text.startswith("decompress could not write the export file") and "Nothing was written" in text
    assert list(outside.iterdir()) == []


def test_a_file_system_without_modes_keeps_the_token(tmp_path, monkeypatch):
    """A data dir where every file reports 0777 and chmod changes nothing (vfat or exfat mounted with
    umask=000, WSL's /mnt/c without metadata, CIFS file_mode=0777): the token bili itself wrote and
    tightened is used, as its store's files are, not refused as writable by others."""
    import os
    import stat as stat_mod

    from bili_addon import private

    root = str(tmp_path)
    real = {name: getattr(os, name) for name in ("stat", "lstat", "fstat", "chmod", "fchmod", "open")}
    ours: dict[int, bool] = {}

    def under(p) -> bool:
        return str(p).startswith(root)

    def wide(st):
        return os.stat_result((stat_mod.S_IFMT(st.st_mode) | 0o777, *tuple(st)[1:]))

    def opened(p, *a, **k):
        fd = real["open"](p, *a, **k)
        ours[fd] = under(p)
        return fd

    monkeypatch.setattr(os, "stat", lambda p, *a, **k: wide(real["stat"](p, *a, **k)) if under(p) else real["stat"](p, *a, **k))
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: wide(real["lstat"](p, *a, **k)) if under(p) else real["lstat"](p, *a, **k))
    monkeypatch.setattr(os, "fstat", lambda fd: wide(real["fstat"](fd)) if ours.get(fd) else real["fstat"](fd))
    monkeypatch.setattr(os, "chmod", lambda p, *a, **k: None if under(p) else real["chmod"](p, *a, **k))
    monkeypatch.setattr(os, "fchmod", lambda fd, m: None if ours.get(fd) else real["fchmod"](fd, m))
    monkeypatch.setattr(os, "open", opened)
    data = tmp_path / "data"
    token = private.ensure_token(data)
    assert token and private.read_token(data) == token and private.ensure_token(data) == token
    assert private.refusal(data) is None
