"""One tcp://HOST:PORT parser for every transport (each one's own acceptance is tested with it)."""

import pytest

from splitrl.transport.endpoints import TcpEndpoint, parse_tcp_endpoint, require_tcp_endpoint


@pytest.mark.parametrize("endpoint, host, address, port", [
    ("tcp://127.0.0.1:5555", "127.0.0.1", "127.0.0.1", 5555),
    ("tcp://server.example.org:0", "server.example.org", "server.example.org", 0),
    ("tcp://*:7000", "*", "*", 7000),
    ("tcp://[::1]:9000", "[::1]", "::1", 9000),
    ("tcp://localhost:65535", "localhost", "localhost", 65535),
])
def test_parts(endpoint, host, address, port):
    tcp = parse_tcp_endpoint(endpoint)
    assert tcp == TcpEndpoint(host, port) and tcp.address == address
    assert tcp.with_port(port) == endpoint


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1", "tcp://127.0.0.1:http", "tcp://:5", "tcp://a/b:5", "tcp://[::1:5", "udp://127.0.0.1:5555",
    "ipc:///tmp/x", "inproc://x", "127.0.0.1:5555", "", None, 5555, "tcp://127.0.0.1:*",
])
def test_not_a_tcp_endpoint(endpoint):
    assert parse_tcp_endpoint(endpoint) is None


def test_wildcard_port_only_when_asked():
    assert parse_tcp_endpoint("tcp://127.0.0.1:*", wildcard_port=True) == TcpEndpoint("127.0.0.1", None)


def test_port_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match="out of range"):
        parse_tcp_endpoint("tcp://127.0.0.1:65536")


def test_a_tcp_only_transport_names_itself():
    assert require_tcp_endpoint("tcp://127.0.0.1:1", "TcpTransport").port == 1
    with pytest.raises(ValueError, match="TcpTransport needs a tcp://HOST:PORT endpoint, got 'ipc:///x'"):
        require_tcp_endpoint("ipc:///x", "TcpTransport")
