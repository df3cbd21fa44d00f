"""The proxy's dialect-neutral request path: sampling, checks, one generation or embedding from
any dialect, grammars, images (runs in the proxy). It talks to engines through `proxy/engines/`
and never imports a dialect."""
