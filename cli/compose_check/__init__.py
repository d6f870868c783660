"""`omnirelay compose-check` (`make compose-check`): the compose stack built and run in real
containers, on the host's Docker engine, and checked end to end (docs/compose.md, "What the check
proves"). ``engine`` gets a Docker engine and a compose command, ``images`` the base, stand-in and
omnirelay images, ``stack`` runs compose, ``probes`` checks the running stack, ``run`` ties them
together and prints the report."""
