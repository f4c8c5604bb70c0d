"""`tcli download multi30k`: checksums, atomic writes, skip-if-present, file:// and a local HTTP server."""

from __future__ import annotations

import functools
import hashlib
import http.server
import threading

import pytest

from transformer_cli.download import MULTI30K_SHA256, download_dataset
from transformer_cli.errors import DataError, TcliError
from tests.conftest import run_tcli


def test_the_kept_sums_match_the_shared_copy(multi30k):
    for name, digest in MULTI30K_SHA256.items():
        assert hashlib.sha256((multi30k / name).read_bytes()).hexdigest() == digest, name


@pytest.fixture()
def mirror(tmp_path, multi30k):
    folder = tmp_path / "mirror"
    folder.mkdir()
    for name in MULTI30K_SHA256:
        (folder / name).write_bytes((multi30k / name).read_bytes())
    return folder


def test_download_from_file_url_then_skip(mirror, tmp_path, multi30k):
    dest = tmp_path / "out"
    paths = download_dataset("multi30k", dest, base_url=mirror.as_uri(), quiet=True)
    assert sorted(p.name for p in paths) == sorted(MULTI30K_SHA256)
    for p in paths:
        assert p.read_bytes() == (multi30k / p.name).read_bytes()
    stamps = {p.name: p.stat().st_mtime_ns for p in paths}
    (mirror / "val.de.gz").write_bytes(b"changed on the server")  # not fetched again: local copy is valid
    download_dataset("multi30k", dest, base_url=mirror.as_uri(), quiet=True)
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == stamps


def test_corrupt_download_leaves_nothing(mirror, tmp_path):
    (mirror / "val.en.gz").write_bytes(b"not the real file")
    dest = tmp_path / "out"
    with pytest.raises(TcliError, match="val.en.gz: sha256 .* does not match"):
        download_dataset("multi30k", dest, base_url=mirror.as_uri(), files=["val.de.gz", "val.en.gz"], quiet=True)
    assert sorted(p.name for p in dest.iterdir()) == ["val.de.gz"]  # no val.en.gz, no temporary file


def test_corrupt_local_copy_is_replaced(mirror, tmp_path, multi30k):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "val.de.gz").write_bytes(b"truncated")
    download_dataset("multi30k", dest, base_url=mirror.as_uri(), files=["val.de.gz"], quiet=True)
    assert (dest / "val.de.gz").read_bytes() == (multi30k / "val.de.gz").read_bytes()


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown data set 'wmt99'"):
        download_dataset("wmt99", "x")


def test_download_over_http_with_progress_on_stderr(mirror, tmp_path):
    handler = functools.partial(QuietHandler, directory=str(mirror))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        result = run_tcli("download", "multi30k", "--dest", tmp_path / "out", "--base-url", url)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [str(tmp_path / "out" / n) for n in MULTI30K_SHA256]
        assert "train.de.gz: " in result.stderr and "%|" in result.stderr  # the tqdm bar
        (mirror / "test_2016_flickr.fr.gz").write_bytes(b"corrupt")
        (tmp_path / "out" / "test_2016_flickr.fr.gz").unlink()
        bad = run_tcli("download", "multi30k", "--dest", tmp_path / "out", "--base-url", url, "--quiet")
        assert bad.returncode == 1 and bad.stderr.startswith("error: ") and "does not match" in bad.stderr
        assert not (tmp_path / "out" / "test_2016_flickr.fr.gz").exists()
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_server_creates_nothing(tmp_path):
    result = run_tcli("download", "multi30k", "--dest", tmp_path / "out", "--base-url", "http://127.0.0.1:9/", "-q")
    assert result.returncode == 1 and "cannot download http://127.0.0.1:9/train.de.gz" in result.stderr
    assert not (tmp_path / "out").exists()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass
