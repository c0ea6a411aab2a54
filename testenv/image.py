"""The project's container image, built from its Dockerfile with docker, for pods on the test node.

No image registry is reachable, so everything the build needs is made here and cached:
- a base image: Debian bookworm with python3 and python3-venv, made by mmdebstrap from Debian's
  packages and imported into docker (the Dockerfile takes it as its BASE_IMAGE build argument);
- a wheelhouse: the project's dependencies as wheels built by the host's pip, copied into the build
  context, so the Dockerfile's install step needs no network (docker runs it with --network=none);
- the pause image for containerd's pod sandboxes: a static program that waits for a signal.

docker runs as a private daemon (own socket, data root in the cache, no bridge, no iptables), only
while building. The image is saved as a tarball named by a hash of everything that goes into it, so
an unchanged tree reuses the tarball without starting docker at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testenv._common import (
    ServiceUnavailable,
    apt_install,
    cache_dir,
    file_lock,
    log_tail,
    progress,
    run_logged,
    unmount_under,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]
IMAGE_NAME = "agent-dispatch"
IMAGE_TAG = "0.1.0"
IMAGE_REF = f"{IMAGE_NAME}:{IMAGE_TAG}"
BASE_REF = "agent-dispatch-base:bookworm-python3"
PAUSE_REF = "agent-dispatch-pause:1"
DEBIAN_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
HOST_PACKAGES = {"dockerd": "docker.io", "mmdebstrap": "mmdebstrap", "gcc": "gcc"}
DOCKER_READY_TIMEOUT_S = 60.0
BUILD_TIMEOUT_S = 1800.0

#: What the image is made of: any change here makes a new image.
IMAGE_INPUTS = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "docker", "agent_dispatch")

PAUSE_SOURCE = r"""
/* The pod sandbox's process: holds the pod's namespaces and waits for a signal to end. */
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, done);
    signal(SIGTERM, done);
    for (;;) pause();
}
"""


@dataclass(frozen=True)
class BuiltImages:
    """Tarballs (docker save format) ready for ``ctr images import``, with their references."""

    app: Path
    app_ref: str
    pause: Path
    pause_ref: str
    size_bytes: int
    build_seconds: float


def _ensure_host_tools() -> None:
    missing = [package for tool, package in HOST_PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        apt_install(missing, cache_dir("logs") / "apt-image.log")


def _tree_digest() -> str:
    digest = hashlib.sha256()
    for name in IMAGE_INPUTS:
        path = ROOT / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts or file.suffix == ".pyc" or "wheelhouse" in file.parts:
                continue
            digest.update(str(file.relative_to(ROOT)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


class DockerDaemon:
    """A private dockerd for builds: its own socket and exec root, images kept in the cache."""

    def __init__(self) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="agent-dispatch-docker-"))
        self.socket = self.run_dir / "docker.sock"
        self.log = cache_dir("logs") / "dockerd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DockerDaemon:
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                [
                    "dockerd",
                    f"--host=unix://{self.socket}",
                    f"--data-root={cache_dir('docker')}",
                    f"--exec-root={self.run_dir / 'exec'}",
                    f"--pidfile={self.run_dir / 'docker.pid'}",
                    # Builds run with --network=none: no bridge, no NAT, no rules in the host's iptables.
                    "--bridge=none",
                    "--iptables=false",
                    "--ip-masq=false",
                    "--ip-forward=false",
                    "--storage-driver=overlay2",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_until(
            lambda: self.docker("version", check=False).returncode == 0,
            timeout=DOCKER_READY_TIMEOUT_S,
            what="dockerd",
            log=self.log,
            proc=self._proc,
            interval=0.5,
        )
        return self

    def docker(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, DOCKER_HOST=f"unix://{self.socket}", DOCKER_BUILDKIT="0")
        proc = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
        if check and proc.returncode != 0:
            raise ServiceUnavailable(
                f"docker {' '.join(args[:3])} failed:\n{proc.stdout[-2000:]}{proc.stderr}"
            )
        return proc

    def has_image(self, ref: str) -> bool:
        return self.docker("image", "inspect", ref, check=False).returncode == 0

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        # dockerd leaves its exec root's mounts behind only if killed; unmount what is left.
        unmount_under(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)


@contextlib.contextmanager
def docker_daemon() -> Iterator[DockerDaemon]:
    daemon = DockerDaemon().start()
    try:
        yield daemon
    finally:
        daemon.stop()


def _base_image(daemon: DockerDaemon) -> None:
    """Debian bookworm with python3 and venv, from Debian's packages (no registry involved)."""
    if daemon.has_image(BASE_REF):
        return
    tarball = cache_dir("image") / f"base-{DEBIAN_SUITE}.tar"
    if not tarball.is_file():
        progress(f"making the base image with mmdebstrap ({DEBIAN_SUITE}, once per machine)")
        partial = tarball.with_name(tarball.stem + ".partial.tar")
        run_logged(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--format=tar",
                f"--include={','.join(BASE_PACKAGES)}",
                # Same command name as the official Python images, so one Dockerfile serves both.
                '--customize-hook=chroot "$1" ln -sf /usr/bin/python3 /usr/local/bin/python',
                '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
                DEBIAN_SUITE,
                str(partial),
            ],
            cache_dir("logs") / "mmdebstrap.log",
            timeout=BUILD_TIMEOUT_S,
        )
        partial.rename(tarball)
    daemon.docker("import", "--change", 'CMD ["python3"]', str(tarball), BASE_REF, timeout=BUILD_TIMEOUT_S)


def _pause_image(daemon: DockerDaemon, out: Path) -> None:
    if out.is_file():
        return
    with tempfile.TemporaryDirectory() as tmp:
        source, root = Path(tmp, "pause.c"), Path(tmp, "root")
        root.mkdir()
        source.write_text(PAUSE_SOURCE)
        run_logged(
            ["gcc", "-static", "-Os", "-s", "-o", root / "pause", source], cache_dir("logs") / "pause.log"
        )
        layer = Path(tmp, "pause.tar")
        run_logged(["tar", "-C", root, "-cf", layer, "pause"], cache_dir("logs") / "pause.log")
        daemon.docker("import", "--change", 'ENTRYPOINT ["/pause"]', str(layer), PAUSE_REF)
    partial = out.with_suffix(".partial")
    daemon.docker("save", "-o", str(partial), PAUSE_REF)
    partial.rename(out)


def wheelhouse(target: Path) -> None:
    """The dependencies as wheels, built by the host's pip (the image's Python is also 3.11).

    The image build and the clean-venv test of its install script (tests/deploy) both install
    from this, offline; the wheels are cached, so only new or changed dependencies are fetched."""
    target.mkdir(parents=True, exist_ok=True)
    for old in target.glob("*.whl"):
        old.unlink()
    cached = cache_dir("image", "wheels")
    log = cache_dir("logs") / "wheelhouse.log"
    # Held while copying too: another process filling the cache meanwhile would leave a
    # half-written wheel for this one to copy.
    with file_lock(cache_dir("image") / "wheels.lock", BUILD_TIMEOUT_S + 60):
        run_logged(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--wheel-dir",
                cached,
                "--find-links",
                cached,
                "--only-binary=:all:",
                # The build backend, so the project's wheel builds offline inside the image.
                "setuptools>=68",
                "wheel",
                "pip",
                f"{ROOT}",
            ],
            log,
            timeout=BUILD_TIMEOUT_S,
        )
        for wheel in cached.glob("*.whl"):
            if not wheel.name.startswith("agent_dispatch-"):
                shutil.copy2(wheel, target / wheel.name)


def build_images() -> BuiltImages:
    """Build (or reuse) the app and pause image tarballs; returns their paths and references."""
    _ensure_host_tools()
    image_dir = cache_dir("image")
    digest = _tree_digest()
    app_tar = image_dir / f"{IMAGE_NAME}-{digest}.tar"
    pause_tar = image_dir / "pause-1.tar"
    with file_lock(image_dir / "build.lock", BUILD_TIMEOUT_S + 600):
        if app_tar.is_file() and pause_tar.is_file():
            return BuiltImages(app_tar, IMAGE_REF, pause_tar, PAUSE_REF, _image_size(app_tar), 0.0)
        started = time.monotonic()
        with docker_daemon() as daemon:
            _base_image(daemon)
            _pause_image(daemon, pause_tar)
            if not app_tar.is_file():
                progress(f"building {IMAGE_REF} from the Dockerfile (base {BASE_REF}, wheels from the host)")
                wheels = ROOT / "docker" / "wheelhouse"
                wheelhouse(wheels)
                build = daemon.docker(
                    "build",
                    "--network=none",
                    "--build-arg",
                    f"BASE_IMAGE={BASE_REF}",
                    "--build-arg",
                    "WHEELHOUSE=/src/docker/wheelhouse",
                    "-t",
                    IMAGE_REF,
                    str(ROOT),
                    check=False,
                    timeout=BUILD_TIMEOUT_S,
                )
                (cache_dir("logs") / "docker-build.log").write_text(build.stdout + build.stderr)
                if build.returncode != 0:
                    raise ServiceUnavailable(
                        f"docker build failed\n{log_tail(cache_dir('logs') / 'docker-build.log')}"
                    )
                for stale in image_dir.glob(f"{IMAGE_NAME}-*.tar"):
                    stale.unlink()
                partial = app_tar.with_suffix(".partial")
                daemon.docker("save", "-o", str(partial), IMAGE_REF)
                partial.rename(app_tar)
                daemon.docker("image", "prune", "--force", check=False)
        elapsed = time.monotonic() - started
        progress(f"image {IMAGE_REF} ready in {elapsed:.0f}s ({_image_size(app_tar) / 2**20:.0f} MiB saved)")
        return BuiltImages(app_tar, IMAGE_REF, pause_tar, PAUSE_REF, _image_size(app_tar), elapsed)


def _image_size(tarball: Path) -> int:
    return tarball.stat().st_size
