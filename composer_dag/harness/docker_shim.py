"""A ``docker`` executable for harnesses that run their commands in a container (mini-swe-agent's
``docker`` environment, and any that shells out the same way): ``run -d`` answers the episode's
sandbox as the container, ``exec [-w DIR] [-e K=V]... ID CMD...`` runs CMD there (through the
episode's runner, over the unix socket ``$COMPOSER_SHELL_SOCKET``) and passes its output and
exit code through; ``rm``, ``stop``, ``kill`` succeed (the runner ends the sandbox). Anything else
exits 125, as docker does for a command it cannot run. Stand-alone: standard library only."""

import json
import os
import socket
import sys


def read_line(sock) -> bytes:
    """One newline-ended message from ``sock`` (b"" if the peer closed first): both ends use it."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            return b""
        data += chunk
    return data


def ask(request: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(os.environ["COMPOSER_SHELL_SOCKET"])
        s.sendall(json.dumps(request).encode() + b"\n")
        data = read_line(s)
    return json.loads(data or b'{"exit_code": 125, "output": "the episode runner closed the connection\\n"}')


def _exec(args: list[str]) -> int:
    cwd, env, i = None, {}, 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        if flag in ("-w", "--workdir"):
            cwd, i = args[i + 1], i + 2
        elif flag in ("-e", "--env"):
            k, _, v = args[i + 1].partition("=")
            env[k], i = v, i + 2
        elif flag in ("-i", "-t", "-it", "--interactive", "--tty"):
            i += 1
        else:
            sys.stderr.write(f"docker exec: unsupported option {flag}\n")
            return 125
    argv = args[i + 1:]  # args[i] is the container
    if not argv:
        sys.stderr.write("docker exec: no command\n")
        return 125
    r = ask({"op": "exec", "argv": argv, "cwd": cwd, "env": env})
    sys.stdout.write(r.get("output", ""))
    sys.stdout.flush()
    return int(r.get("exit_code", 125))


def main(argv: list[str]) -> int:
    cmd, rest = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "run":
        print(ask({"op": "start"})["container"])
        return 0
    if cmd == "exec":
        return _exec(rest)
    if cmd in ("rm", "stop", "kill"):
        return 0
    sys.stderr.write(f"docker: '{cmd}' is not available in this environment\n")
    return 125


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
