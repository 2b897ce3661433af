"""Local development spoke: process launchers, mock services, policy publishing and the usage
topic read back, for `gateway dev`, the tests and the benchmarks."""
