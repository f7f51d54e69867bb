"""bili in a mitmproxy of the user's own: every module the package imports is declared in
``pyproject.toml``, and a fresh venv holding mitmproxy alone, once the checkout is installed into it
(what ``pipx inject mitmproxy bili-addon`` and ``uv tool install mitmproxy --with bili-addon`` do),
runs ``mitmdump -s "$(bili addon-path)"`` with the addon answering ``/__bili/health``."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bili_addon"


def third_party_imports() -> dict[str, set[str]]:
    """``{module: {files importing it}}``: every import in the package (lazy ones inside functions
    included) that is neither the standard library nor the package itself."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "bili_addon":
                    continue
                if name == "compression.zstd" or top == "compression":  # the standard library from Python 3.14
                    continue
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def declared(extra: str | None = None) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower().replace("_", "-") for d in deps}


# an optional extra's modules are imported by its own module only (bili runs without them)
OPTIONAL = {"postgres": {"bili_addon/store_pg.py"}}


def test_every_imported_module_is_declared():
    dists = importlib.metadata.packages_distributions()
    names = declared()
    missing = {}
    for module, files in third_party_imports().items():
        top = module.split(".")[0]
        owners = {d.lower().replace("_", "-") for d in dists.get(top, [])}
        if top == "backports":  # a namespace: backports.zstd
            owners = {module.lower().replace("_", "-")} & {"backports.zstd"} or owners
        if any(owners & declared(x) and files <= where for x, where in OPTIONAL.items()):
            continue
        if not owners & names:
            missing[module] = (sorted(owners), sorted(files))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


# -- a fresh venv: mitmproxy alone, then bili installed into it ----------------------------------------
@pytest.fixture(scope="module")
def mitmproxy_venv(tmp_path_factory):
    """A venv with ``pip install mitmproxy`` and nothing else, as pipx or uv would make it."""
    venv = tmp_path_factory.mktemp("own-mitmproxy") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "mitmproxy>=12,<13"], capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        pytest.skip(f"cannot install mitmproxy from the package index: {r.stderr.strip()[-500:]}")
    r = subprocess.run([str(py), "-c", "import bili_addon"], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode != 0, "a venv with mitmproxy alone should not see bili"
    # the checkout's loader in that mitmproxy says what is missing and how to install it
    r = subprocess.run([str(venv / "bin" / "mitmdump"), "-n", "-s", str(PACKAGE / "addon.py"),
                        "--set", f"confdir={venv.parent / 'conf'}"], capture_output=True, text=True, timeout=120,
                       cwd="/")
    out = r.stdout + r.stderr
    assert "bili: 'bili_addon' cannot be imported by this mitmproxy's Python" in out, out[-3000:]
    assert "pipx inject --include-apps mitmproxy bili-addon" in out
    # the inject: a regular (non-editable) install of this checkout into mitmproxy's environment
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(REPO)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return venv


@pytest.mark.e2e
def test_the_declared_dependencies_are_enough(mitmproxy_venv):
    """Every module of the package, and every third-party module it imports lazily, imports in a venv
    built from mitmproxy and the declared dependencies alone."""
    # the optional extras' modules excepted: their own modules import without them (store_pg says
    # to install the extra when it is chosen)
    modules = sorted(m for m, files in third_party_imports().items()
                     if not any(files <= where for where in OPTIONAL.values()))
    script = (
        "import importlib, pkgutil, sys\n"
        "import bili_addon\n"
        "assert bili_addon.__file__.startswith(sys.prefix), bili_addon.__file__\n"
        "for m in pkgutil.walk_packages(bili_addon.__path__, 'bili_addon.'):\n"
        "    importlib.import_module(m.name)\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    py = mitmproxy_venv / "bin" / "python"
    r = subprocess.run([str(py), "-c", script, *modules], capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.e2e
def test_mitmdump_of_its_own_loads_the_installed_addon(mitmproxy_venv, tmp_path):
    from e2e.support import ADDON, Mitmdump

    bili = mitmproxy_venv / "bin" / "bili"
    r = subprocess.run([str(bili), "addon-path"], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    addon = Path(r.stdout.strip())
    assert addon.is_file() and addon.is_relative_to(mitmproxy_venv), addon  # the installed copy, not the checkout

    class Own(Mitmdump):
        """That venv's mitmdump with ``-s "$(bili addon-path)"``."""

        def command(self) -> list[str]:
            cmd = super().command()
            cmd[0] = str(mitmproxy_venv / "bin" / "mitmdump")
            cmd[cmd.index(str(ADDON))] = str(addon)
            return cmd

    proxy = Own(tmp_path, 9, options={"connection_strategy": "lazy"})  # the upstream is never asked
    proxy.start(timeout=60)
    try:
        health = proxy.health()
        assert health["ok"] and health["mode"] == "fold" and health["store"], health
        assert str(addon) in proxy.log()  # mitmproxy says which script it loaded
    finally:
        proxy.stop()
    assert "Traceback" not in proxy.log() and "ModuleNotFoundError" not in proxy.log(), proxy.log_tail()
