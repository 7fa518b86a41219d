package main

// The control plane owns a tiny PKI in DATA_DIR/pki: a CA, the apiserver's serving certificate, the
// service-account signing key pair and an admin client certificate in system:masters. Everything is
// created once and reused, so a restart with the same data directory keeps the credentials that
// clients and service-account tokens already hold.

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

const certValidity = 10 * 365 * 24 * time.Hour

// serviceIP is the first address of serviceCIDR: the ClusterIP of the `kubernetes` Service, which a
// serving certificate must name for in-cluster clients.
const (
	serviceCIDR = "10.0.0.0/24"
	serviceIP   = "10.0.0.1"
)

type pki struct {
	dir string
}

func (p pki) path(name string) string { return filepath.Join(p.dir, name) }

func (p pki) CACert() string      { return p.path("ca.crt") }
func (p pki) CAKey() string       { return p.path("ca.key") }
func (p pki) ServingCert() string { return p.path("apiserver.crt") }
func (p pki) ServingKey() string  { return p.path("apiserver.key") }
func (p pki) SAKey() string       { return p.path("sa.key") }
func (p pki) SAPub() string       { return p.path("sa.pub") }
func (p pki) AdminCert() string   { return p.path("admin.crt") }
func (p pki) AdminKey() string    { return p.path("admin.key") }

// ensure creates whatever part of the PKI is missing. A file that exists is trusted as is: the
// data directory is ours, and regenerating the CA would invalidate every credential issued before.
func (p pki) ensure() error {
	if err := os.MkdirAll(p.dir, 0o700); err != nil {
		return err
	}
	if !exists(p.CACert()) || !exists(p.CAKey()) {
		key, err := newKey()
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			Subject:               pkix.Name{CommonName: "gpufrac-controlplane-ca"},
			IsCA:                  true,
			BasicConstraintsValid: true,
			KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		}
		der, err := sign(tmpl, &key.PublicKey, nil, key)
		if err != nil {
			return err
		}
		if err := writeKeyPair(p.CACert(), p.CAKey(), der, key); err != nil {
			return err
		}
	}
	caCert, caKey, err := loadKeyPair(p.CACert(), p.CAKey())
	if err != nil {
		return fmt.Errorf("loading CA: %w", err)
	}

	if !exists(p.ServingCert()) || !exists(p.ServingKey()) {
		tmpl := &x509.Certificate{
			Subject:     pkix.Name{CommonName: "kube-apiserver"},
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			DNSNames: []string{
				"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
				"kubernetes.default.svc.cluster.local",
			},
			IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1"), net.ParseIP(serviceIP)},
		}
		if err := p.issue(tmpl, p.ServingCert(), p.ServingKey(), caCert, caKey); err != nil {
			return err
		}
	}

	if !exists(p.AdminCert()) || !exists(p.AdminKey()) {
		tmpl := &x509.Certificate{
			Subject:     pkix.Name{CommonName: "gpufrac-admin", Organization: []string{"system:masters"}},
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}
		if err := p.issue(tmpl, p.AdminCert(), p.AdminKey(), caCert, caKey); err != nil {
			return err
		}
	}

	if !exists(p.SAKey()) || !exists(p.SAPub()) {
		key, err := newKey()
		if err != nil {
			return err
		}
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return err
		}
		pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
		if err != nil {
			return err
		}
		if err := writePEM(p.SAKey(), "EC PRIVATE KEY", keyDER, 0o600); err != nil {
			return err
		}
		if err := writePEM(p.SAPub(), "PUBLIC KEY", pubDER, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func (p pki) issue(tmpl *x509.Certificate, certPath, keyPath string, ca *x509.Certificate, caKey crypto.Signer) error {
	key, err := newKey()
	if err != nil {
		return err
	}
	der, err := sign(tmpl, &key.PublicKey, ca, caKey)
	if err != nil {
		return err
	}
	return writeKeyPair(certPath, keyPath, der, key)
}

// writeKubeconfig writes an admin kubeconfig with the credentials embedded, so the file alone is
// enough for kubectl or lightkube. It is rewritten on every start because the port may change.
func (p pki) writeKubeconfig(path, server string) error {
	ca, err := os.ReadFile(p.CACert())
	if err != nil {
		return err
	}
	cert, err := os.ReadFile(p.AdminCert())
	if err != nil {
		return err
	}
	key, err := os.ReadFile(p.AdminKey())
	if err != nil {
		return err
	}
	b64 := base64.StdEncoding.EncodeToString
	content := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: gpufrac
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: gpufrac-admin
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: gpufrac
  context:
    cluster: gpufrac
    user: gpufrac-admin
    namespace: default
current-context: gpufrac
`, server, b64(ca), b64(cert), b64(key))
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func sign(tmpl *x509.Certificate, pub crypto.PublicKey, parent *x509.Certificate, parentKey crypto.Signer) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(certValidity)
	if parent == nil {
		parent = tmpl
	}
	return x509.CreateCertificate(rand.Reader, tmpl, parent, pub, parentKey)
}

func writeKeyPair(certPath, keyPath string, der []byte, key *ecdsa.PrivateKey) error {
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	// Key first: a certificate without its key would be taken as complete by ensure().
	if err := writePEM(keyPath, "EC PRIVATE KEY", keyDER, 0o600); err != nil {
		return err
	}
	return writePEM(certPath, "CERTIFICATE", der, 0o644)
}

func loadKeyPair(certPath, keyPath string) (*x509.Certificate, crypto.Signer, error) {
	certDER, err := readPEM(certPath, "CERTIFICATE")
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(certDER)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := readPEM(keyPath, "EC PRIVATE KEY")
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.ParseECPrivateKey(keyDER)
	if err != nil {
		return nil, nil, err
	}
	return cert, key, nil
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	data := pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func readPEM(path, typ string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(data)
	if block == nil || block.Type != typ {
		return nil, fmt.Errorf("%s: no PEM block of type %q", path, typ)
	}
	return block.Bytes, nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return !errors.Is(err, os.ErrNotExist)
}
