"""PostgreSQL: the providers of a run's server, the embedded cluster, and the psycopg edge."""
