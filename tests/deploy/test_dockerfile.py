"""Structural lint of deploy/Dockerfile (Docker is not available to build it here)."""

from __future__ import annotations

import json
import re

import pytest

from .common import DEPLOY, ROOT

DOCKERFILE = DEPLOY / "Dockerfile"
PINNED_PYTHON = re.compile(r"^python:3\.11\.\d+-slim-bookworm$")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, args = buf.partition(" ")
        out.append((op.upper(), args.strip()))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


def stages(ins):
    """List of (from_args, [instructions]) per build stage."""
    out = []
    for op, args in ins:
        if op == "FROM":
            out.append((args, []))
        else:
            assert out or op in ("ARG",), f"{op} before the first FROM"
            if out:
                out[-1][1].append((op, args))
    return out


@pytest.fixture(scope="module")
def parsed():
    ins = instructions(DOCKERFILE.read_text())
    return ins, stages(ins)


def test_multi_stage_with_pinned_bases(parsed):
    _, st = parsed
    assert len(st) >= 2
    names = []
    for from_args, _ in st:
        m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", from_args, re.IGNORECASE)
        assert m, f"every stage is named: FROM {from_args}"
        image, name = m.groups()
        names.append(name)
        if image in names[:-1]:
            continue  # FROM an earlier stage
        assert PINNED_PYTHON.match(image), f"base image must be an exact patch tag: {image}"
        assert ":latest" not in image and "$" not in image
    assert names[0] == "builder"
    bases = {re.split(r"\s+", f)[0] for f, _ in st}
    assert len(bases) == 1, f"all stages use the same base tag: {bases}"


def test_builder_builds_a_wheel_and_runtime_installs_it(parsed):
    _, st = parsed
    builder, runtime = st[0][1], st[-1][1]
    assert any(op == "RUN" and re.search(r"pip wheel|python -m build", a) for op, a in builder)
    installs = [a for op, a in runtime if op == "RUN" and "pip install" in a]
    assert installs and all("from=builder" in a or "/wheels" in a for a in installs)
    assert any("--no-index" in a for a in installs), "runtime installs offline from the wheels"
    copied = [a for op, a in builder if op == "COPY"]
    for needed in ("pyproject.toml", "lpcal", "daemon"):
        assert any(needed in a for a in copied), needed


def test_builder_compiles_the_c_accelerator(parsed):
    """The project wheel carries daemon._speedups: the builder has a C compiler and fails the
    build if the wheel came out pure Python; the runtime stage installs no compiler."""
    _, st = parsed
    builder, runtime = st[0][1], st[-1][1]
    runs = [a for op, a in builder if op == "RUN"]
    assert any("apt-get install" in a and "gcc" in a for a in runs)
    assert any("cp311" in a and "sys.exit" in a for a in runs)
    assert not any("gcc" in a for op, a in runtime if op == "RUN")
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert "**/*.so" in ignore  # a locally built module never enters the image


def test_runtime_is_non_root_and_read_only_friendly(parsed):
    _, st = parsed
    runtime = st[-1][1]
    users = [a for op, a in runtime if op == "USER"]
    assert users, "runtime stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid == "10001", "numeric non-root uid (runAsNonRoot can verify it)"
    # the last USER comes after every RUN (nothing runs as root afterwards)
    ops = [op for op, _ in runtime]
    assert max(i for i, op in enumerate(ops) if op == "RUN") < ops.index("USER")
    runs = " ".join(a for op, a in runtime if op == "RUN")
    assert "/var/lib/lpcal" in runs and "10001" in runs  # state dir owned by the user
    assert ("WORKDIR", "/var/lib/lpcal") in runtime
    env = " ".join(a for op, a in runtime if op == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "LPCAL_CONFIG=/etc/lpcal/lpcal.toml" in env


def test_healthcheck_and_entrypoint(parsed):
    _, st = parsed
    runtime = {op: a for op, a in st[-1][1]}
    hc = runtime["HEALTHCHECK"]
    cmd = json.loads(hc[hc.index("CMD") + 3:].strip())
    assert cmd[:2] == ["python", "-c"]
    assert "http://127.0.0.1:8080/healthz" in cmd[2]
    compile(cmd[2], "<healthcheck>", "exec")  # valid Python
    assert re.search(r"--timeout=\d+s", hc) and re.search(r"--interval=\d+s", hc)
    assert json.loads(runtime["ENTRYPOINT"]) == ["lpcal", "serve"]
    assert runtime["EXPOSE"] == "8080"


def test_no_curl_wget_or_latest():
    text = DOCKERFILE.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "latest" not in code
    assert not re.search(r"\b(curl|wget)\b", code)
    assert "ADD " not in code  # COPY only


def test_copied_paths_exist_and_are_in_the_dockerignore(parsed):
    ins, _ = parsed
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for op, args in ins:
        if op != "COPY" or "--from" in args:
            continue
        parts = [p for p in args.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} missing"
            assert f"!{src}" in ignore, f"{src} is excluded by Dockerfile.dockerignore"
