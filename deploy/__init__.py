"""Service templates (launchd user agent, systemd user unit), filled in by
`mlxd service install`."""
