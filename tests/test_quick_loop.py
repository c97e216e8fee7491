"""tests/conftest.py's rule that keeps ``-m "not slow"`` quick: a test that starts the service is
slow, and one that is not slow cannot start it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server_helpers import starts_a_server


@pytest.mark.parametrize("command, starts", [
    ([sys.executable, "-m", "atb_plugin.server", "--model", "m"], True),
    (["bash", "scripts/launch_npu_server.sh", "--port", "1"], True),
    (["/venv/bin/atb-plugin", "serve", "--model", "m"], True),
    ("python -m atb_plugin.server --model m", True),
    ([sys.executable, "-m", "atb_plugin.server", "--help"], False),
    ([sys.executable, "-c", "import atb_plugin.server"], False),
    ([sys.executable, "-m", "atb_plugin.testing.tiny", "--family", "qwen2"], False),
])
def test_which_commands_start_a_server(command, starts):
    assert starts_a_server(command) is starts


def test_a_quick_test_cannot_start_a_server():
    with pytest.raises(pytest.fail.Exception, match="starts a server but is not slow"):
        process = subprocess.Popen([sys.executable, "-m", "atb_plugin.server", "--model", "/nonexistent"])
        process.kill()  # reached only if the guard let it through: the assertion above then fails
        process.wait()


class FakeItem:
    def __init__(self, fixturenames, markers=()):
        self.fixturenames = fixturenames
        self.markers = {name: getattr(pytest.mark, name).mark for name in markers}

    def get_closest_marker(self, name):
        return self.markers.get(name)

    def add_marker(self, marker):
        self.markers[marker.name] = marker.mark


def test_a_test_that_requests_serve_or_is_marked_server_becomes_slow():
    from tests import conftest

    by_fixture, by_marker, quick = FakeItem(["server", "serve"]), FakeItem([], ["server"]), FakeItem(["store"])
    conftest.pytest_collection_modifyitems(None, [by_fixture, by_marker, quick])
    assert by_fixture.get_closest_marker("slow") and by_marker.get_closest_marker("slow")
    assert quick.get_closest_marker("slow") is None
