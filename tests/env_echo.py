# SPDX-License-Identifier: Apache-2.0
"""A stand-in for vLLM's CLI module (`python -m env_echo ...`): prints its arguments and two environment variables."""

import json
import os
import sys

if __name__ == "__main__":  # run, not imported
    env = [os.environ.get("GIVEN_AT_START"), os.environ.get("GIVEN_LATER")]
    print("ECHO " + json.dumps({"argv": sys.argv[1:], "env": env}), flush=True)
