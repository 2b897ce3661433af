"""Local development spoke: process launchers and mock services for `gateway dev` and the tests."""
