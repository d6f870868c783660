"""Running a stack on one host: a local NATS server with its identities and TLS, the plan of the
service processes, and the bus state an operator inspects. The launcher, the tests and the
benchmarks use it; no service does (the contract the services share is :mod:`libs.common`)."""
