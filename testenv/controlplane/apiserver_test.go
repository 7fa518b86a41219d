package main

import (
	"reflect"
	"testing"
)

func TestExtraFlagsReplaceOursOfTheSameName(t *testing.T) {
	ours := []string{"--disable-admission-plugins=ServiceAccount", "--profiling=false"}
	got := withOverrides(ours, []string{"--disable-admission-plugins=", "--enable-aggregator-routing=true"})
	want := []string{"--profiling=false", "--disable-admission-plugins=", "--enable-aggregator-routing=true"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("withOverrides = %q, want %q", got, want)
	}
}
