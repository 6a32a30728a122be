#!/bin/sh
# The dsec roles (docs/deploy.md, "Postgres"): an owner that migrates and a service
# role that does not own the log, each with its password; the database, the owner's.
set -eu
psql -v ON_ERROR_STOP=1 --username postgres --dbname postgres \
    -v owner_pw="$DSEC_OWNER_PASSWORD" -v app_pw="$DSEC_APP_PASSWORD" <<'SQL'
CREATE ROLE dsec_owner LOGIN NOSUPERUSER NOCREATEROLE PASSWORD :'owner_pw';
CREATE ROLE dsec_app LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'app_pw';
CREATE DATABASE dsec OWNER dsec_owner;
REVOKE ALL ON DATABASE dsec FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE dsec TO dsec_owner, dsec_app;
SQL
