#!/bin/sh
# make_test_certs.sh DIR: certificates for the TLS tests, made fresh in DIR
# by the openssl command (P-256 keys, valid for a day):
#   ca.pem ca.key             the test CA
#   server.pem server.key     signed by it, for IP:127.0.0.1 and DNS:localhost
#   client.pem client.key     signed by it, a client certificate
#   other-ca.pem other-ca.key an unrelated CA
#   other.pem other.key       signed by the unrelated CA, for the same names,
#                             usable as server and as client certificate
# Used by tests/support/test_certs.c and the interop scripts alike.
set -eu
dir=$1
cd "$dir"
cat > certs.cnf <<'CNF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectAltName = DNS:test-client
[both]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
CNF
key="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"

# ca NAME: a self-signed CA
ca() {
  openssl req -x509 $key -days 1 -config certs.cnf -extensions ca \
    -subj "/CN=$1" -keyout "$1.key" -out "$1.pem" 2>/dev/null
}
# leaf NAME CA SECTION: a key and a certificate signed by CA
leaf() {
  openssl req -new $key -config certs.cnf -subj "/CN=$1" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" \
    -CAcreateserial -days 1 -extfile certs.cnf -extensions "$3" \
    -out "$1.pem" 2>/dev/null
  rm -f "$1.csr"
}
ca ca
ca other-ca
leaf server ca server
leaf client ca client
leaf other other-ca both
