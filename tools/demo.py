"""Start `specd up` on the default pair, run one `specd generate --chat`, stop the stack.

    python tools/demo.py [--prompt TEXT] [--max-new-tokens N]

The prompt goes as one user message (the default target is an instruct model), greedy.
"""

import argparse
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Write a Python function that reverses a string.")
    parser.add_argument("--max-new-tokens", default="128")
    args = parser.parse_args()
    up = subprocess.Popen([sys.executable, "-m", "specd", "up", "--port", "0", "--metrics-port", "0", "--http-port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        for line in up.stdout:
            print(line, end="", flush=True)
            if line.startswith("coordinator listening on "):
                address = line.split()[-1]
                break
        else:
            return up.wait() or 1
        return subprocess.call(
            [sys.executable, "-m", "specd", "generate", "--address", address, "--chat", "--temperature", "0",
             "--max-new-tokens", args.max_new_tokens, "--", args.prompt]
        )
    finally:
        up.terminate()
        up.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
