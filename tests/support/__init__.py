"""Code shared by the test suites (not tests): the broker-and-daemon harness
(:mod:`tests.support.daemon_harness`) and the client fixtures
(:mod:`tests.support.client_fixtures`)."""
