"""Patches Horovod's sdist so that elastic horovodrun on one host name fails at once.

Without `--network-interface`, an elastic horovodrun compares the network
interfaces of two hosts before it starts any worker, and waits for a
second host to appear for `--elastic-timeout` (600 s) when the discovery
script lists one (`localhost:2` on a single machine), then fails. The
patched driver says so in one line and exits with status 2 as soon as the
listed hosts are known, naming what to do on one machine: pass
`--network-interface lo` and list the machine under one name per worker
(`deploy/local/discover_hosts.sh`, `tfgpt.resilience.local_hosts`).

Usage: python scripts/patch_horovod_elastic.py SDIST_SOURCE_DIR
Exits with an error, changing nothing, if `horovod/runner/gloo_run.py` does
not look like 0.28.1's.
"""

import sys
from pathlib import Path

from patch_horovod_checks import patch

ORIGINAL = """        min_hosts = _get_min_start_hosts(settings)
        current_hosts = driver.wait_for_available_slots(settings.num_proc, min_hosts=min_hosts)
"""

PATCHED = """        min_hosts = _get_min_start_hosts(settings)
        # Patched by tfgpt (scripts/patch_horovod_elastic.py): one host name
        # would wait --elastic-timeout for a second one; say so at once.
        listed = driver.wait_for_available_slots(settings.num_proc).host_assignment_order
        if min_hosts > 1 and len(set(listed)) < 2:
            sys.stderr.write(
                'horovodrun: error: an elastic job without --network-interface compares the '
                'interfaces of two hosts, and the discovery script lists one ({}): on one '
                'machine pass --network-interface lo and list it under one name per worker, '
                'one slot each (tfgpt: deploy/local/discover_hosts.sh)\\n'.format(
                    ', '.join(sorted(set(listed)))))
            sys.stderr.flush()
            os._exit(2)
        current_hosts = driver.wait_for_available_slots(settings.num_proc, min_hosts=min_hosts)
"""


def main(argv):
    return patch(argv, Path("horovod") / "runner" / "gloo_run.py",
                 [ORIGINAL, "\nimport os\n", "\nimport sys\n"], [(ORIGINAL, PATCHED)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
