"""``python -m testenv install [SERVICE...]``: build or download the loopback services ahead of the tests.

Everything lands in the cache (``~/.cache/agent-dispatch`` or ``$AGENT_DISPATCH_CACHE``), keyed by
version, so a second run does nothing. Services: postgres, kafka, kube, helm, keda, node (kubelet,
kube-scheduler, kube-proxy and the Debian packages a node runs), image (the project's image from
its Dockerfile, and the pause image) (default: all).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from testenv._common import ServiceUnavailable, progress

# service -> (module, function that installs it)
INSTALLERS = {
    "postgres": ("testenv.postgres", "ensure_installed"),
    "kafka": ("testenv.kafka", "ensure_installed"),
    "kube": ("testenv.kube", "ensure_built"),
    "helm": ("testenv.helm", "ensure_helm"),
    "keda": ("testenv.keda", "ensure_keda"),
    "node": ("testenv.node", "ensure_node_built"),
    "image": ("testenv.image", "build_images"),
    "browser": ("testenv.browser", "ensure_browser"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testenv")
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="build or download services into the cache")
    install.add_argument("services", nargs="*", metavar="SERVICE", help=f"any of {', '.join(INSTALLERS)}")
    args = parser.parse_args(argv)
    unknown = set(args.services) - set(INSTALLERS)
    if unknown:
        parser.error(f"unknown service(s): {', '.join(sorted(unknown))}")
    failed = False
    for name in args.services or list(INSTALLERS):
        module_name, function = INSTALLERS[name]
        started = time.monotonic()
        progress(f"installing {name} ...")
        try:
            getattr(importlib.import_module(module_name), function)()
        except ServiceUnavailable as exc:
            failed = True
            print(f"[testenv] {name}: FAILED\n{exc}", file=sys.stderr)
            continue
        progress(f"{name} ready ({time.monotonic() - started:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
