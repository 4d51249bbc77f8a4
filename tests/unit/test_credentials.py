"""Credentials are read once, by one function, for every purpose: the one bearer token of a request (HTTP headers or
gRPC metadata), who it names (tenant, priority floor) and whether it may call at all (issue #45, item 1)."""

import pytest

from runtime.config import ServerConfig
from runtime.server.auth import Unauthenticated, authorization_values, bearer_token, identify
from runtime.server.tenants import Tenant

ALPHA = Tenant("alpha", "key-alpha-0001", requests_per_minute=2, priority_floor=-3)


def test_one_bearer_token_any_scheme_case():
    assert bearer_token([]) is None
    for value in ("Bearer abc", "bearer abc", "BEARER abc", "  Bearer   abc  ", "Bearer\tabc"):
        assert bearer_token([value]) == "abc"
    for value in ("Basic YWJj", "Bearer", "Bearer ", "abc", "Bearer a b", ""):
        assert bearer_token([value]) is None             # not a bearer credential: as good as none


def test_more_than_one_credential_is_refused():
    for values in (["Bearer a", "Bearer b"], ["Bearer a", "Bearer a"], ["Basic x", "Bearer a"], ["", ""]):
        with pytest.raises(Unauthenticated, match="more than one"):
            bearer_token(values)


def test_authorization_values_keep_every_entry():
    """Both transports hand over every entry: a dict of headers keeps one and hides the other."""
    assert authorization_values([(b"host", b"x"), (b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")]) \
        == ["Bearer a", "Bearer b"]
    assert authorization_values((("authorization", "Bearer a"), ("x-other", "1"))) == ["Bearer a"]
    assert authorization_values(None) == []


def test_identify_names_tenant_and_floor_from_the_same_token():
    config = ServerConfig(tenants=(ALPHA,), priority_keys=(("vip-key-0001", -9),), priority_floor=2)
    caller = identify(["bearer key-alpha-0001"], config)
    assert (caller.tenant, caller.priority_floor, caller.label) == (ALPHA, -3, "alpha")
    vip = identify(["Bearer vip-key-0001"], config)
    assert (vip.tenant, vip.priority_floor, vip.label) == (None, -9, "default")
    for values in ([], ["Bearer nope"], ["Basic a2V5LWFscGhhLTAwMDE="]):
        with pytest.raises(Unauthenticated, match="missing or wrong"):
            identify(values, config)                      # tenants require a key
    with pytest.raises(Unauthenticated, match="more than one"):
        identify(["Bearer garbage", "Bearer key-alpha-0001"], config)


def test_open_server_still_refuses_two_credentials():
    config = ServerConfig(priority_keys=(("vip-key-0001", -9),), priority_floor=2)
    assert identify([], config).priority_floor == 2
    assert identify(["Bearer unknown"], config).priority_floor == 2
    assert identify(["BEARER vip-key-0001"], config).priority_floor == -9
    with pytest.raises(Unauthenticated):
        identify(["Bearer unknown", "Bearer vip-key-0001"], config)
