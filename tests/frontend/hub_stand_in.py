"""A stand-in for the Hugging Face Hub on 127.0.0.1: what huggingface_hub's ``snapshot_download``
calls, and nothing more, for tests that cannot reach the real one (``HF_ENDPOINT``).

The endpoints and headers are those the installed huggingface_hub reads:
  GET  /api/models/{repo}/revision/{rev}   model info: ``id``, ``sha`` (the commit), ``siblings``
  GET  /api/models/{repo}/tree/{rev}       the file listing (``type``, ``path``, ``size``,
                                           ``oid``; ``lfs`` for weights), one page
  HEAD /{repo}/resolve/{rev}/{file}        ``X-Repo-Commit``, ``ETag``, ``Content-Length``
  GET  /{repo}/resolve/{rev}/{file}        the bytes; ``Range: bytes=N-`` answered with a 206
Errors carry the ``X-Error-Code`` huggingface_hub maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``). Switches: ``cut_once[file] = N`` sends the first GET of
``file`` N bytes then drops the connection; ``fail`` answers every GET of its files with a 500;
``stall`` sends half a file then waits until the hub stops. Every request is logged.

Runs in the test process, on a thread.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None

    @property
    def file(self) -> str | None:
        """The repository file a resolve request names (None for API calls)."""
        match = re.match(r"/[^/]+/[^/]+/resolve/[^/]+/(.+)", self.path)
        return match and match.group(1)


@dataclass
class Repo:
    files: dict[str, bytes]
    # branch or tag -> commit; every commit holds the same files.
    refs: dict[str, str]


@dataclass
class StandInHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)
    fail: set[str] = field(default_factory=set)
    stall: set[str] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def add_repo(self, repo_id: str, files: dict[str, bytes], refs: dict[str, str]) -> None:
        self.repos[repo_id] = Repo(files, refs)

    def gets(self, file: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.file == file]

    def start(self) -> str:
        """Serve on a free port of 127.0.0.1; the URL, for HF_ENDPOINT."""
        hub = self

        class Handler(_Handler):
            stand_in = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._server.server_close()


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin"))


def _etag(name: str, data: bytes) -> str:
    # The Hub's: an LFS file's sha256, else the git blob id; quoted.
    digest = hashlib.sha256(data).hexdigest() if _is_lfs(name) else _git_blob_id(data)
    return f'"{digest}"'


class _Handler(BaseHTTPRequestHandler):
    stand_in: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        hub = self.stand_in
        hub.requests.append(
            Request(
                self.command,
                path,
                self.headers.get("Range"),
                self.headers.get("Authorization"),
            )
        )
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
            self._model_info(*match.groups())
        elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
            self._tree(*match.groups())
        elif match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            self._resolve(*match.groups(), send_body=send_body)
        else:
            self._error(404, "RepoNotFound", "no such endpoint")

    def _commit(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        repo = self.stand_in.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        commits = set(repo.refs.values())
        commit = revision if revision in commits else repo.refs.get(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _model_info(self, repo_id: str, revision: str) -> None:
        if (found := self._commit(repo_id, revision)) is None:
            return
        repo, commit = found
        siblings = [{"rfilename": name} for name in repo.files]
        self._json({"id": repo_id, "sha": commit, "private": False, "siblings": siblings})

    def _tree(self, repo_id: str, revision: str) -> None:
        if (found := self._commit(repo_id, revision)) is None:
            return
        entries = []
        for name, data in found[0].files.items():
            entry = {"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)}
            if _is_lfs(name):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self._json(entries)

    def _resolve(self, repo_id: str, revision: str, name: str, send_body: bool) -> None:
        if (found := self._commit(repo_id, revision)) is None:
            return
        repo, commit = found
        data = repo.files.get(name)
        if data is None:
            self._error(404, "EntryNotFound", f"{name} not found", commit)
            return
        hub = self.stand_in
        if send_body and name in hub.fail:
            self._error(500, None, "stand-in failure", commit)
            return
        start = 0
        if send_body and (wanted := self.headers.get("Range")):
            start = int(re.fullmatch(r"bytes=(\d+)-", wanted).group(1))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", _etag(name, data))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not send_body:
            return
        if name in hub.cut_once:
            self._cut(data, hub.cut_once.pop(name))
        elif name in hub.stall:
            self._cut(data, len(data) // 2, wait=True)
        else:
            self.wfile.write(data[start:])

    def _cut(self, data: bytes, at: int, wait: bool = False) -> None:
        """Part of the body, then the connection dropped (or held open until the hub stops)."""
        self.wfile.write(data[:at])
        self.wfile.flush()
        if wait:
            self.stand_in.stopped.wait()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _json(self, value: object) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, commit: str | None = None):
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)
