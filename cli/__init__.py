"""The `mlxd` command (runs in the user's process): `serve` hands over to `mlxd.daemon`; `status`,
`models`, `flush`, `stop`, `socket`, `chat`, `run` talk to a running daemon over its Unix socket;
`service` installs it as a launchd or systemd user service. Nothing else imports this package."""
