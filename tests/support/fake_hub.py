"""A local HTTP server that answers as the Hugging Face Hub does for public model repos, serving
model directories from disk, for tests that fetch (the Hub is not reachable from the tests).
Point `HF_ENDPOINT` at `hub.url`. It answers what `huggingface_hub` asks when it lists a repo
(`/api/models/{repo}[/revision/{rev}]`) and downloads a file (`HEAD`, then `GET` of
`/{repo}/resolve/{rev}/{file}`); everything else is a 404."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos  # repo id -> directory whose files it serves
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.requests.append(f"HEAD {self.path}")
                self._file(body=False)

            def do_GET(self) -> None:
                hub.requests.append(f"GET {self.path}")
                if self.path.startswith("/api/models/"):
                    self._info()
                else:
                    self._file(body=True)

            def _info(self) -> None:
                path = self.path.split("?")[0][len("/api/models/"):]
                repo = path.split("/revision/")[0]
                if repo not in hub.repos:
                    return self._missing()
                files = sorted(p for p in hub.repos[repo].iterdir() if p.is_file())
                body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": p.name, "size": p.stat().st_size}
                                                for p in files]}).encode()
                self._send(200, body, {"Content-Type": "application/json"})

            def _file(self, body: bool) -> None:
                repo, sep, rest = self.path.partition("/resolve/")
                repo = repo.lstrip("/")
                name = rest.partition("/")[2]
                path = hub.repos.get(repo, Path("/nonexistent")) / name
                if not sep or not path.is_file():
                    return self._missing()
                data = path.read_bytes()
                self._send(200, data if body else b"", {
                    "X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                    "Content-Length": str(len(data))}, length=len(data))

            def _missing(self) -> None:
                self._send(404, b'{"error": "Repository not found"}',
                           {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})

            def _send(self, status: int, body: bytes, headers: dict[str, str],
                      length: int | None = None) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body) if length is None
                                                           else length))
                self.end_headers()
                if body:
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
