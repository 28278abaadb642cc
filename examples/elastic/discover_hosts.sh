#!/bin/sh
# Host discovery for the elastic example: print the hosts the job may use now, one "host:slots" per line.
# horovodrun runs this every second; edit the hosts file while the job runs to add or remove hosts.
exec cat "${HOROVOD_EXAMPLE_HOSTS:-$(dirname "$0")/hosts.txt}"
