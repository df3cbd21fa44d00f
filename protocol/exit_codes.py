"""Child exit codes that carry meaning for the supervisor's restart policy."""

OK = 0
CRASH = 1              # anything unexpected: restart with backoff
CONFIG_ERROR = 78      # EX_CONFIG: bad configuration or a model that cannot load; do not retry
PARENT_GONE = 79       # the supervisor died; the child followed it
