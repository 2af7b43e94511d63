"""One long-lived ``mergekit-yaml`` / ``mergekit-moe``: runs the command's own entry point once per request, in one
process.

Started by ``run_peer.MergekitWorker`` in the mergekit venv. Each stdin line is a JSON request
``{"argv": [...], "log": "path", "command": "mergekit-yaml"}``: the arguments the command would get (``command``
defaults to ``mergekit-yaml``; ``mergekit-moe`` runs mergekit's MoE builder). The run's stdout and stderr (file
descriptors 1 and 2, so C-level output too) go to the log; the reply ``{"rc": N}`` is one line on the original stdout.
mergekit's model-loader cache is emptied before each run, so no run sees another's files. What it saves is the
interpreter start and mergekit's imports, ~6.5 s a run; the merge itself is mergekit's, unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> int:
    from mergekit.io.tasks import LoaderCache
    from mergekit.scripts.moe import main as mergekit_moe
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    commands = {"mergekit-yaml": mergekit_yaml, "mergekit-moe": mergekit_moe}

    reply = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        job = json.loads(line)
        LoaderCache.loaders.clear()
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        try:
            name = job.get("command", "mergekit-yaml")
            code = commands[name].main(args=job["argv"], prog_name=name, standalone_mode=False)
            rc = int(code or 0)
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # noqa: BLE001  (reported in the log, as the command would print it)
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps({"rc": rc}) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
