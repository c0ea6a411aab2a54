// kindcheck decodes a kind cluster configuration the way kind itself does
// (sigs.k8s.io/kind/pkg/internal/apis/config/encoding.Parse, which other modules cannot import):
// it reads kind and apiVersion, decodes the file strictly (an unknown field is an error) into
// kind's public v1alpha4 types, applies kind's defaults, and prints the result as JSON.
// Built and run by tests/deploy/test_kind.py against the sigs.k8s.io/kind module.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"

	yaml "go.yaml.in/yaml/v3"
	"sigs.k8s.io/kind/pkg/apis/config/v1alpha4"
)

type typeMeta struct {
	Kind       string `yaml:"kind,omitempty"`
	APIVersion string `yaml:"apiVersion,omitempty"`
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "kindcheck: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) != 2 {
		fail("usage: kindcheck CONFIG")
	}
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		fail("error reading file: %v", err)
	}
	tm := typeMeta{}
	if err := yaml.Unmarshal(raw, &tm); err != nil {
		fail("could not determine kind / apiVersion for config: %v", err)
	}
	if tm.APIVersion != "kind.x-k8s.io/v1alpha4" {
		fail("unknown apiVersion: %s", tm.APIVersion)
	}
	if tm.Kind != "Cluster" {
		fail("unknown kind %s for apiVersion: %s", tm.Kind, tm.APIVersion)
	}
	cfg := &v1alpha4.Cluster{}
	decoder := yaml.NewDecoder(bytes.NewReader(raw))
	decoder.KnownFields(true)
	if err := decoder.Decode(cfg); err != nil {
		fail("unable to decode config: %v", err)
	}
	v1alpha4.SetDefaultsCluster(cfg)
	out, err := json.Marshal(cfg)
	if err != nil {
		fail("cannot encode config: %v", err)
	}
	fmt.Println(string(out))
}
